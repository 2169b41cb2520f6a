"""``pi-run``: generate text from a GGUF or PowerInfer GGUF (llama.cpp's flag names).

``--bench`` runs greedy decoding without printing text and reports where the
time went: tokens/s, the FFN (and predictor) share of decode time, the mean
share of neurons computed, and the weight bytes read per token.
"""
from __future__ import annotations

import logging
import math
import statistics
import sys

from typing import TYPE_CHECKING

import click

from ..cli_params import (PiCommand, FiniteFloat, cache_type_options, check_cache_type, check_ctx_size, check_threads,
                          plural, rate, require_file, require_gguf, version_option)
from ..errors import PowerInferError, cli_errors
from ..limits import MAX_BUDGET_GIB

if TYPE_CHECKING:  # torch and the runtime load when the command runs, so --help answers at once
    from .generate import GenStats
    from .model import Transformer

MAX_PROMPT_FILE_BYTES = 16 << 20  # -f: larger files are refused
SEED_MAX = 2**63 - 1
DTYPE_NAMES = ("bf16", "f32")  # runtime.weights.DTYPES, named here without importing torch


def read_prompt_file(path: str) -> str:
    """``-f``: the file's text (UTF-8; one trailing newline dropped, as llama.cpp does);
    PowerInferError for a missing, too large, binary or non-UTF-8 file."""
    p = require_file(path, "-f")
    if not p.is_file():  # a FIFO would block, /dev/zero never ends
        raise PowerInferError(f"-f {path}: not a file")
    size = p.stat().st_size
    if size > MAX_PROMPT_FILE_BYTES:
        raise PowerInferError(f"-f {path}: {size / 2**20:.1f} MiB is more than a prompt file may be "
                              f"({MAX_PROMPT_FILE_BYTES >> 20} MiB)")
    data = p.read_bytes()
    if b"\0" in data:
        raise PowerInferError(f"-f {path}: a binary file (it has NUL bytes), not text")
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise PowerInferError(f"-f {path}: not UTF-8 text (invalid byte at offset {e.start})") from None
    return text.removeprefix("\ufeff").removesuffix("\n")


def check_text(text: str, what: str) -> str:
    """PowerInferError if ``text`` holds undecodable bytes (click keeps invalid UTF-8 from the
    command line as lone surrogates, which the tokenizers cannot take)."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise PowerInferError(f"{what}: not valid UTF-8 text (an invalid byte at character {e.start})") from None
    return text


def check_sampler(n_predict: int, temp: float, top_k: int, top_p: float, seed: int,
                  repeat_penalty: float, repeat_last_n: int, min_p: float = 0.0) -> None:
    """The sampling flags' ranges (NaN and infinities refused); raises PowerInferError."""
    if n_predict < -1:
        raise PowerInferError(f"-n {n_predict}: must be >= 0, or -1 (until the end of text or the context is full)")
    for flag, v in (("--temp", temp), ("--top-p", top_p), ("--repeat-penalty", repeat_penalty)):
        if not math.isfinite(v):
            raise PowerInferError(f"{flag} {v}: must be a finite number")
    if temp < 0:
        raise PowerInferError(f"--temp {temp}: must be >= 0 (0: greedy)")
    if not (math.isfinite(min_p) and 0 <= min_p <= 1):
        raise PowerInferError(f"--min-p {min_p}: must be in [0, 1] (0: off)")
    if not 0 < top_p <= 1:
        raise PowerInferError(f"--top-p {top_p}: must be in (0, 1] (1: off)")
    if top_k < 0:
        raise PowerInferError(f"--top-k {top_k}: must be >= 0 (0: all tokens)")
    if not -1 <= seed <= SEED_MAX:
        raise PowerInferError(f"--seed {seed}: must be between -1 (random) and {SEED_MAX}")
    if repeat_penalty <= 0:
        raise PowerInferError(f"--repeat-penalty {repeat_penalty}: must be > 0 (1.0: off)")
    if repeat_last_n < -1:
        raise PowerInferError(f"--repeat-last-n {repeat_last_n}: must be >= 0, or -1 (the context size)")


def format_bytes(nb: float) -> str:
    """``1.23 MB``, or ``45.6 KB`` below 0.1 MB (a small model's bytes per token do not round to 0)."""
    return f"{nb / 1e6:.2f} MB" if nb >= 1e5 else f"{nb / 1e3:.1f} KB"








def _threads() -> str:
    import torch

    n = torch.get_num_threads()
    return f"{n} thread{'s' if n > 1 else ''}"


def _kv_types(model: "Transformer") -> str:
    """``f16`` (keys and values alike) or ``f16/f32`` (keys/values): the KV cache's types."""
    from .kv_cache import type_name

    k, v = (type_name(t) for t in model.cache_dtypes)
    return k if k == v else f"{k}/{v}"


def bench_report(model: "Transformer", st: "GenStats", path: str) -> str:
    """The ``--bench`` summary: speed, where decode time goes, sparsity, bytes per token."""
    from . import kernels
    from .generate import decode_bytes_per_token, ffn_mode

    from .weights import weight_type

    mode = ffn_mode(model)
    ffn = model.layers[0].ffn
    ws = (model.layers[0].wqkv, getattr(ffn, "up", None), getattr(ffn, "fc1", None))  # a HybridFFN has neither
    types = dict.fromkeys(weight_type(w) for w in ws if w is not None)
    lines = [f"bench: {path} ({model.args.family.name}, {mode}, weights {'/'.join(types)} computed in "
             f"{str(model.dtype).removeprefix('torch.')}, KV cache {_kv_types(model)}, kernels {kernels.backend()}, "
             f"{_threads()})",
             f"prompt: {plural(st.n_prompt, 'token')} in {st.t_prompt * 1e3:.1f} ms{rate(st.n_prompt, st.t_prompt)}"]
    if st.t_steps:
        tps = sorted(1.0 / t for t in st.t_steps)
        lines.append(f"decode: {plural(st.n_eval, 'token')} in {st.t_gen * 1e3:.1f} ms ({st.gen_tps:.1f} tokens/s; per step "
                     f"median {statistics.median(tps):.1f}, min {tps[0]:.1f}, max {tps[-1]:.1f} tokens/s)")
        lines.append(f"  FFN {100 * st.ffn_share:.1f}% of decode time (predictor {100 * st.predict_share:.1f}%), "
                     f"attention + output + rest {100 * (1 - st.ffn_share):.1f}%")
        teal = getattr(model, "teal", None) is not None  # input-sparse: its own lines below
        if st.decode_active_share is not None and not teal:
            fired = "" if st.decode_fired_share is None else f"; {100 * st.decode_fired_share:.1f}% fired"
            lines.append(f"  FFN neurons computed: {100 * st.decode_active_share:.1f}% of n_ff on average "
                         f"(predicted active{fired})")
        if teal:
            from .input_sparse import bytes_per_token

            nb = bytes_per_token(model)
        else:
            nb = decode_bytes_per_token(model, st.decode_active_share, st.decode_fired_share)
        lines.append(f"  weights read: {format_bytes(nb)} per token -> {nb * st.gen_tps / 1e9:.1f} GB/s effective")
    from .hybrid import placement_lines  # --vram-budget: MB per device, busy share of decode time

    lines += placement_lines(model, st.n_eval)
    from .input_sparse import sparsity_lines  # TEAL files: inputs zeroed per matrix kind

    lines += sparsity_lines(model)
    from .cold_rows import budget_lines  # --ram-budget: resident MB by kind, reads per token, hit rate

    lines += budget_lines(model)
    return "\n".join(lines) + "\n"


@click.command(cls=PiCommand, context_settings={"help_option_names": ["-h", "--help"]})
@click.option("-m", "--model", "model_path", required=True, type=click.Path(dir_okay=False),
              help="GGUF (dense) or PowerInfer GGUF (PWRI magic, sparse) file.")
@click.option("-p", "--prompt", default="Once upon a time", show_default=True,
              help="Text to continue (BOS is added as the model's tokenizer says).")
@click.option("-f", "--file", "prompt_file", default=None,
              help="Read the prompt from this UTF-8 text file (at most 16 MiB; one trailing newline dropped) "
                   "instead of -p.")
@click.option("-n", "--n-predict", default=128, show_default=True,
              help="Tokens to generate; -1: until the end of text or the context is full.")
@click.option("-c", "--ctx-size", default=0, help="Context length (0: the model's, at most 4096; larger values are cut to the model's).")
@click.option("--temp", default=0.8, show_default=True, help="Temperature; 0 = greedy.")
@click.option("--top-k", default=40, show_default=True, help="Sample among the k most likely tokens (0: all).")
@click.option("--top-p", default=0.95, show_default=True,
              help="Then keep the smallest set whose probability reaches p (1.0: off), as llama.cpp does.")
@click.option("--min-p", default=0.0, show_default=True,
              help="Then keep tokens at least this share of the most likely one's probability, as llama.cpp "
                   "does; 0.0: off (llama.cpp's default is 0.05).")
@click.option("--repeat-penalty", default=1.0, show_default=True,
              help="Divide positive logits (multiply negative ones) of the tokens among the last "
                   "--repeat-last-n by this, as llama.cpp does; 1.0: off (llama.cpp's default is 1.1).")
@click.option("--repeat-last-n", default=64, show_default=True,
              help="Tokens of history (prompt included) the repeat penalty looks at; 0: off, -1: the context size.")
@click.option("-s", "--seed", default=-1, show_default=True, help="RNG seed (-1: random).")
@click.option("--ignore-eos", is_flag=True,
              help="Keep generating past the end of text (EOS, or BOS emitted by llama2.c-style models).")
@click.option("-t", "--threads", default=0,
              help="CPU threads (0: 1 for models under 64 MB of weights per token, else torch's default).")
@click.option("--dense", is_flag=True, help="Compute every FFN neuron even in a PWRI file.")
@click.option("--vram-budget", type=FiniteFloat(0, MAX_BUDGET_GIB), default=None,
              help="GiB of GPU memory: hot FFN neurons go to the GPU, cold ones stay on the CPU.")
@click.option("--ram-budget", type=FiniteFloat(0, MAX_BUDGET_GIB), default=None,
              help="GiB of RAM the process may keep resident (everything counted): attention, predictors, output, "
                   "KV cache and the hottest FFN neurons stay resident, the other FFN rows are read from the file "
                   "when predicted active (PWRI files).")
@click.option("--activation", "activation_dir", type=click.Path(file_okay=False), default=None,
              help="Activation folder for the neuron placement (default: activation/ beside the model).")
@click.option("--reset-gpu-index", is_flag=True, help="Re-solve the placement even if a matching index exists.")
@click.option("--disable-gpu-index", is_flag=True, help="Ignore --vram-budget and the GPU index: CPU only.")
@click.option("--dtype", type=click.Choice(["auto", *DTYPE_NAMES]), default="auto", show_default=True,
              help="Compute dtype on the CPU (auto: bf16 if the CPU has bf16 dot products, else f32).")
@click.option("--kernels", "kernel_backend", type=click.Choice(["auto", "c", "torch"]), default=None,
              help="Decode kernels: c (compiled once, fastest), torch (plain torch ops); "
                   "default auto, or $POWERINFER_KERNELS.")
@click.option("-cnv", "--conversation", is_flag=True,
              help="Chat in the terminal with the model's chat template (ChatML when the file has none); "
                   "-p or -sys is the system prompt. The KV cache is kept between turns; Ctrl-C stops a reply, "
                   "Ctrl-D or Ctrl-C at the prompt ends the chat.")
@click.option("-i", "--interactive", is_flag=True,
              help="Continue the prompt, then read a line, append it, continue again (plain text, no template).")
@click.option("-sys", "--system-prompt", default=None, help="The system message for -cnv.")
@click.option("--chat-template-kwargs", "template_kwargs", default=None, metavar="JSON",
              help="Template variables for -cnv, a JSON object, e.g. '{\"enable_thinking\": false}' (Qwen3) or "
                   "'{\"date_string\": \"03 Dec 2026\"}' (Llama 3.x), as llama.cpp's option.")
@click.option("--bench", is_flag=True,
              help="Greedy, ignore EOS, no text: report tokens/s, FFN share of decode time, active share.")
@cache_type_options
@version_option("pi-run")
@cli_errors
def main(model_path, prompt, prompt_file, n_predict, ctx_size, temp, top_k, top_p, min_p, repeat_penalty, repeat_last_n,
         seed, ignore_eos, threads, dense, vram_budget, ram_budget, activation_dir, reset_gpu_index, disable_gpu_index, dtype,
         kernel_backend, conversation, interactive, system_prompt, template_kwargs, bench, cache_type_k,
         cache_type_v):
    """Generate text with sparse FFNs: only the neurons the predictor marks active are computed."""
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s: %(message)s")
    # every value and input file is checked before torch is imported (seconds on a cold start)
    check_sampler(n_predict, temp, top_k, top_p, seed, repeat_penalty, repeat_last_n, min_p)
    check_ctx_size(ctx_size)
    check_threads(threads)
    check_cache_type(cache_type_k, "--cache-type-k")
    check_cache_type(cache_type_v, "--cache-type-v")
    require_gguf(model_path)
    if prompt_file is not None:
        if click.get_current_context().get_parameter_source("prompt") == click.core.ParameterSource.COMMANDLINE:
            raise PowerInferError("-p and -f: give the prompt one way, not both")
        prompt = read_prompt_file(prompt_file)
    else:
        check_text(prompt, "-p")
    if conversation and interactive:
        raise PowerInferError("-cnv and -i: choose one (-cnv chats with the model's template, -i continues plain text)")
    if (conversation or interactive) and bench:
        raise PowerInferError("--bench runs without input: it cannot be combined with -cnv or -i")
    if system_prompt is not None:
        if not conversation:
            raise PowerInferError("-sys: a system prompt is for chat mode (-cnv)")
        src = click.get_current_context().get_parameter_source("prompt")
        if src == click.core.ParameterSource.COMMANDLINE or prompt_file is not None:
            raise PowerInferError("-sys and -p/-f: in chat mode both set the system prompt; give one")
        check_text(system_prompt, "-sys")
    if template_kwargs is not None:
        if not conversation:
            raise PowerInferError("--chat-template-kwargs: template variables are for chat mode (-cnv)")
        from .chat import check_template_kwargs

        template_kwargs = check_template_kwargs(template_kwargs, "--chat-template-kwargs")
    if conversation:
        from .chat import check_file_template

        check_file_template(model_path, template_kwargs)  # a broken template is named before the model loads
    from . import kernels
    from .generate import SamplerSettings, count_fired, generate
    from .loading import open_for_inference
    from .session import Session

    model, tok = open_for_inference(
        model_path, dtype=dtype, dense=dense, ctx_size=ctx_size, threads=threads, kernel_backend=kernel_backend,
        vram_budget=vram_budget, ram_budget=ram_budget, activation_dir=activation_dir, reset_gpu_index=reset_gpu_index,
        disable_gpu_index=disable_gpu_index, note=lambda s: click.echo(s, err=True), cache_type_k=cache_type_k,
        cache_type_v=cache_type_v)
    sampler = SamplerSettings(temp, top_k, top_p, seed, repeat_penalty, repeat_last_n, min_p)
    if conversation:
        src = click.get_current_context().get_parameter_source("prompt")
        given = src == click.core.ParameterSource.COMMANDLINE or prompt_file is not None
        system = system_prompt if system_prompt is not None else (prompt if given else None)
        return run_chat(model, tok, sampler, n_predict, system, ignore_eos, template_kwargs)
    ids = tok.encode(prompt)
    if len(ids) >= model.n_ctx:
        hint = (f"shorten it or raise -c up to the model's context length {model.max_ctx}"
                if model.n_ctx < model.max_ctx else "shorten it: this is the model's context length")
        raise PowerInferError(f"prompt: {len(ids)} tokens do not fit the context length {model.n_ctx} ({hint})")
    if bench:
        count_fired(model)
        st = generate(model, ids, n_predict, SamplerSettings(temp=0.0), None)
        sys.stdout.write(bench_report(model, st, model_path))
        return
    if interactive:
        sys.stdout.write(prompt)
        sys.stdout.flush()
        return run_interactive(model, tok, ids, sampler, n_predict, ignore_eos)
    out = sys.stdout
    out.write(prompt)
    out.flush()

    def on_text(piece: str) -> None:
        out.write(piece)
        out.flush()

    from .interactive import _Interrupt

    # Ctrl-C stops at the next token and still prints the timings so far, exit code 130 (128 + SIGINT),
    # as llama.cpp's tools print their perf summary on SIGINT
    with _Interrupt() as intr:
        st, _ = Session(model, tok).generate_text(ids, n_predict, sampler, on_text, ignore_eos=ignore_eos,
                                                  should_stop=lambda: intr.hit)
    out.write("\n")
    out.flush()
    print_timings(model, model_path, st, n_predict, interrupted=intr.hit)
    if intr.hit:
        click.get_current_context().exit(130)


def print_timings(model, model_path: str, st, n_predict: int, interrupted: bool = False) -> None:
    """pi-run's summary on stderr: the model, prompt and generation counts and times, FFN shares."""
    from . import kernels
    from .generate import ffn_mode

    mode = ffn_mode(model)
    err = sys.stderr
    if interrupted:
        err.write(f"note: interrupted (Ctrl-C) after {plural(st.n_gen, 'token')}\n")
    elif st.stop == "context":
        err.write(f"note: the context is full ({model.n_ctx} tokens): stopped after {plural(st.n_gen, 'token')}"
                  + (f" of -n {n_predict}" if n_predict >= 0 else "") + "\n")
    err.write(f"\nmodel: {model_path} ({model.args.family.name}, {mode}, {str(model.dtype).removeprefix('torch.')}, "
              f"kernels {kernels.backend()}, {_threads()})\n")
    err.write(f"prompt eval: {plural(st.n_prompt, 'token')} in {st.t_prompt * 1e3:.1f} ms"
              f"{rate(st.n_prompt, st.t_prompt)}\n")
    err.write(f"generation:  {plural(st.n_gen, 'token')}, {plural(st.n_eval, 'eval')} in {st.t_gen * 1e3:.1f} ms"
              f"{rate(st.n_eval, st.t_gen)}\n")
    if st.t_steps:
        err.write(f"FFN share of decode time: {100 * st.ffn_share:.1f}% (predictor {100 * st.predict_share:.1f}%)\n")
    if st.active_share is not None:
        err.write(f"FFN neurons computed: {100 * st.active_share:.1f}% of n_ff on average (predicted active)\n")


def _read_line(prompt: str) -> str:
    try:
        import readline  # noqa: F401 (line editing and history for input(), where available)
    except ImportError:
        pass
    return input(prompt)


def _summary(log, model) -> None:
    n_eval = sum(t.n_prompt for t in log.turns)
    n_reused = sum(t.n_reused for t in log.turns)
    n_gen = sum(t.n_gen for t in log.turns)
    t_gen = sum(t.t_gen for t in log.turns)
    n_steps = sum(t.n_eval for t in log.turns)
    tps = f", {n_steps / t_gen:.1f} tokens/s" if t_gen > 0 and n_steps else ""
    sys.stderr.write(f"\n{plural(len(log.turns), 'turn')}: {plural(n_eval, 'prompt token')} evaluated, {n_reused} "
                     f"reused from the KV cache, {n_gen} generated{tps} ({'dense' if model.dense else 'sparse'})\n")


def run_chat(model, tok, sampler, n_predict, system, ignore_eos, template_kwargs=None) -> None:
    """``-cnv``: the terminal chat (see :mod:`powerinfer.runtime.interactive`); ``template_kwargs``:
    variables for every render of the template (checked)."""
    from .chat import template_for
    from .interactive import chat_loop
    from .session import Session

    template = template_for(tok, template_kwargs)
    if template.is_default:
        sys.stderr.write("note: this model has no chat template (tokenizer.chat_template); using ChatML\n")
    log = chat_loop(Session(model, tok), template, sampler, n_predict, _read_line, sys.stdout, sys.stderr,
                    system=system, ignore_eos=ignore_eos)
    _summary(log, model)


def run_interactive(model, tok, ids, sampler, n_predict, ignore_eos) -> None:
    """``-i``: plain-text continuation turn by turn."""
    from .interactive import interactive_loop
    from .session import Session

    log = interactive_loop(Session(model, tok), ids, sampler, n_predict, _read_line, sys.stdout, sys.stderr,
                           ignore_eos=ignore_eos)
    _summary(log, model)


if __name__ == "__main__":
    main()
