"""``pi-server``: serve one model over HTTP (OpenAI's API and llama.cpp's ``/completion``).

FastAPI + uvicorn: the most used Python ASGI stack, kept up by active maintainers; pydantic
validates every request body, and streaming responses and client disconnects come with it.
The server binds 127.0.0.1 unless ``--host`` says otherwise; ``--api-key`` (or
``$POWERINFER_API_KEY``) then requires ``Authorization: Bearer <key>`` on every endpoint
but ``/health``.
"""
from __future__ import annotations

import logging
import sys

import click

from ..cli_params import (PiCommand, FiniteFloat, cache_type_options, check_cache_type, check_ctx_size, check_threads,
                          version_option)
from ..errors import PowerInferError, cli_errors
from ..limits import MAX_BUDGET_GIB
from ..runtime.cli import DTYPE_NAMES

MAX_BODY_BYTES = 4 << 20
DEFAULT_SLOT_PROMPT_SIMILARITY = 0.5  # scheduler.DEFAULT_SLOT_PROMPT_SIMILARITY (not imported here: torch)


def _check_port_free(host: str, port: int) -> None:
    """PowerInferError when ``host:port`` cannot be bound, before minutes go into loading a model."""
    import socket

    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except socket.gaierror as e:
        raise PowerInferError(f"--host {host}: not an address ({e.strerror})") from None
    family, _, _, _, addr = infos[0]
    with socket.socket(family, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(addr)
        except OSError as e:
            raise PowerInferError(f"cannot listen on {host}:{port}: {e.strerror} (another server there? "
                                  f"choose another --port)") from None


@click.command(cls=PiCommand, context_settings={"help_option_names": ["-h", "--help"]})
@click.option("-m", "--model", "model_path", required=True, type=click.Path(dir_okay=False),
              help="GGUF (dense) or PowerInfer GGUF (sparse) file.")
@click.option("--host", default="127.0.0.1", show_default=True,
              help="Address to bind; 0.0.0.0 serves other machines too (set --api-key then).")
@click.option("--port", default=8080, show_default=True, type=click.IntRange(0, 65535), help="TCP port (0: any free).")
@click.option("-c", "--ctx-size", default=0,
              help="Context length in all, split evenly across the -np slots as llama-server splits it (0: the model's).")
@click.option("-np", "--parallel", "n_parallel", default=1, show_default=True, type=click.IntRange(1, 256),
              help="Slots: requests decoded at once, one token each per batched step (continuous batching).")
@click.option("-ub", "--ubatch-size", "ubatch", default=32, show_default=True, type=click.IntRange(1, 1 << 16),
              help="With -np > 1: prompt tokens evaluated per batched step beside the generating slots' tokens "
                   "(a running stream waits at most one such step for a new prompt).")
@click.option("--ffn-batch", type=click.Choice(["auto", "union", "per-seq"]), default="auto", show_default=True,
              help="Sparse FFN over a batch: union of the sequences' active rows, per-sequence rows, or by measured batch size.")
@click.option("--metrics", "metrics", is_flag=True, help="Serve GET /metrics (Prometheus text format).")
@click.option("-t", "--threads", default=0, help="CPU threads (0: chosen by model size, as pi-run).")
@click.option("--dense", is_flag=True, help="Compute every FFN neuron even in a PWRI file.")
@click.option("--dtype", type=click.Choice(["auto", *DTYPE_NAMES]), default="auto", show_default=True,
              help="Compute dtype on the CPU.")
@click.option("--kernels", "kernel_backend", type=click.Choice(["auto", "c", "torch"]), default=None,
              help="Decode kernels (default auto, or $POWERINFER_KERNELS).")
@click.option("--vram-budget", type=FiniteFloat(0, MAX_BUDGET_GIB), default=None, help="GiB of GPU memory for hot neurons, as pi-run.")
@click.option("--ram-budget", type=FiniteFloat(0, MAX_BUDGET_GIB), default=None,
              help="GiB of RAM to stay within: hot FFN neurons resident, cold rows read from the file, as pi-run.")
@click.option("-a", "--alias", default=None, help="The model's name in the API (default: the file name).")
@click.option("--api-key", envvar="POWERINFER_API_KEY", default=None,
              help="Require 'Authorization: Bearer KEY' (also $POWERINFER_API_KEY).")
@click.option("--max-queue", default=64, show_default=True, type=click.IntRange(1, 1 << 16),
              help="Requests that may wait for the model; more get 503.")
@click.option("--chat-template-kwargs", "template_kwargs", default=None, metavar="JSON",
              help="Template variables for every chat, a JSON object, e.g. '{\"enable_thinking\": false}' (Qwen3); "
                   "a request's chat_template_kwargs go over them (as llama-server).")
@click.option("--reasoning-format", type=click.Choice(["auto", "deepseek", "none"]), default="auto", show_default=True,
              help="A thinking model's <think>...</think> text: returned apart as reasoning_content (auto, deepseek), "
                   "or left in content (none); a request's reasoning_format overrides it.")
@click.option("-sps", "--slot-prompt-similarity", "similarity", type=FiniteFloat(0, 1),
              default=DEFAULT_SLOT_PROMPT_SIMILARITY, show_default=True,
              help="With -np > 1: a request takes the idle slot whose cache holds more than this share of its "
                   "prompt (llama-server's -sps, whose default is 0.1); else the least recently used slot "
                   "(0: always that).")
@click.option("--log-level", type=click.Choice(["debug", "info", "warning", "error"]), default="info",
              show_default=True)
@cache_type_options
@version_option("pi-server")
@cli_errors
def main(model_path, host, port, ctx_size, n_parallel, ubatch, ffn_batch, metrics, threads, dense, dtype,
         kernel_backend, vram_budget, ram_budget, alias, api_key, max_queue, template_kwargs, reasoning_format,
         similarity, log_level, cache_type_k, cache_type_v):
    """Serve a model: POST /v1/completions, /v1/chat/completions (stream or not), /completion, /apply-template;
    GET /v1/models, /health, /slots, /metrics. -np N requests are decoded at once (continuous batching), more wait
    in arrival order."""
    logging.basicConfig(level=log_level.upper(), format="%(levelname)s: %(message)s")
    if api_key is not None and not api_key.strip():
        raise PowerInferError("--api-key: empty")
    if ram_budget is not None and n_parallel > 1:
        raise PowerInferError("--ram-budget with -np > 1: not supported yet (batched steps read every sequence's "
                              "FFN rows from full matrices); serve one request at a time under a RAM budget")
    check_ctx_size(ctx_size)
    check_threads(threads)
    check_cache_type(cache_type_k, "--cache-type-k")
    check_cache_type(cache_type_v, "--cache-type-v")
    from ..runtime.chat import check_file_template, check_template_kwargs

    template_kwargs = check_template_kwargs(template_kwargs, "--chat-template-kwargs")
    # the header only (the model loads after the port check): a bad file or chat template is named first
    check_file_template(model_path, template_kwargs)
    _check_port_free(host, port)
    import uvicorn

    from ..runtime.chat import template_for
    from ..runtime.loading import open_for_inference
    from .app import ServerState, create_app
    from .scheduler import Scheduler

    model, tok = open_for_inference(model_path, dtype=dtype, dense=dense, ctx_size=ctx_size, threads=threads,
                                    kernel_backend=kernel_backend, vram_budget=vram_budget, ram_budget=ram_budget,
                                    note=lambda s: click.echo(s, err=True), cache_type_k=cache_type_k,
                                    cache_type_v=cache_type_v)
    template = template_for(tok, template_kwargs)
    engine = Scheduler(model, tok, n_parallel, max_queue=max_queue, ubatch=ubatch, ffn_mode=ffn_batch,
                       slot_prompt_similarity=similarity)
    state = ServerState(engine, model_path, alias, api_key, MAX_BODY_BYTES, template, metrics=metrics,
                        reasoning_format=reasoning_format)
    app = create_app(state)
    from ..runtime.generate import ffn_mode

    mode = ffn_mode(model)
    click.echo(f"pi-server: {state.model_id} ({model.args.family.name}, {mode}, n_ctx {model.n_ctx}"
               f"{f' = {n_parallel} slots x {engine.n_ctx}' if n_parallel > 1 else ''}"
               f"{', ChatML (no template in the file)' if template.is_default else ', chat template from the file'})",
               err=True)
    if host not in ("127.0.0.1", "localhost", "::1") and api_key is None:
        click.echo(f"warning: serving on {host} without --api-key: anyone who can reach it can use it", err=True)
    config = uvicorn.Config(app, host=host, port=port, log_level=log_level, access_log=log_level == "debug",
                            timeout_graceful_shutdown=2)

    class Server(uvicorn.Server):
        def handle_exit(self, sig, frame) -> None:  # Ctrl-C / SIGTERM: end running streams now
            engine.shutdown(timeout=10)  # the worker leaves its step before the process exits
            super().handle_exit(sig, frame)

    server = Server(config)
    try:
        server.run()
    except KeyboardInterrupt:  # uvicorn re-raises the Ctrl-C it handled: the shutdown is done
        pass
    finally:
        engine.close()
    if not server.started:
        raise PowerInferError(f"could not listen on {host}:{port} (in use, or not an address of this machine?)")


if __name__ == "__main__":
    sys.exit(main())
