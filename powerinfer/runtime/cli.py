"""``pi-run``: generate text from a GGUF or PowerInfer GGUF (llama.cpp's flag names)."""
from __future__ import annotations

import sys

import click
import torch

from ..errors import PowerInferError, cli_errors
from ..formats.gguf_file import open_gguf
from .generate import SamplerSettings, generate
from .hybrid import offload
from .model import Transformer
from .tokenizer import GGUFTokenizer, TextStream

DTYPES = {"f32": torch.float32, "bf16": torch.bfloat16}


def load_model(path: str, dtype: str = "f32", dense: bool = False, n_ctx: int | None = None):
    """Open ``path`` and build the runtime model and its tokenizer."""
    g = open_gguf(path)
    model = Transformer(g, DTYPES[dtype], dense=dense, n_ctx=n_ctx)
    return model, GGUFTokenizer(g)


@click.command(context_settings={"help_option_names": ["-h", "--help"]})
@click.option("-m", "--model", "model_path", required=True, type=click.Path(dir_okay=False),
              help="GGUF (dense) or PowerInfer GGUF (PWRI magic, sparse) file.")
@click.option("-p", "--prompt", default="Once upon a time", show_default=True)
@click.option("-n", "--n-predict", default=128, show_default=True, help="Tokens to generate.")
@click.option("-c", "--ctx-size", default=0, help="Context length (0: the model's).")
@click.option("--temp", default=0.8, show_default=True, help="Temperature; 0 = greedy.")
@click.option("--top-k", default=40, show_default=True)
@click.option("--top-p", default=0.95, show_default=True)
@click.option("-s", "--seed", default=-1, show_default=True, help="RNG seed (-1: random).")
@click.option("-t", "--threads", default=0, help="CPU threads (0: torch's default).")
@click.option("--dense", is_flag=True, help="Compute every FFN neuron even in a PWRI file.")
@click.option("--vram-budget", type=float, default=None,
              help="GiB of GPU memory: hot FFN neurons go to the GPU, cold ones stay on the CPU.")
@click.option("--activation", "activation_dir", type=click.Path(file_okay=False), default=None,
              help="Activation folder for the neuron placement (default: activation/ beside the model).")
@click.option("--reset-gpu-index", is_flag=True, help="Re-solve the placement even if a matching index exists.")
@click.option("--disable-gpu-index", is_flag=True, help="Ignore --vram-budget and the GPU index: CPU only.")
@click.option("--dtype", type=click.Choice(sorted(DTYPES)), default="f32", show_default=True,
              help="Compute dtype on the CPU.")
@cli_errors
def main(model_path, prompt, n_predict, ctx_size, temp, top_k, top_p, seed, threads, dense, vram_budget,
         activation_dir, reset_gpu_index, disable_gpu_index, dtype):
    """Generate text with sparse FFNs: only the neurons the predictor marks active are computed."""
    if n_predict < 0:
        raise PowerInferError(f"-n {n_predict}: must be >= 0")
    if threads > 0:
        torch.set_num_threads(threads)
    model, tok = load_model(model_path, dtype, dense, ctx_size or None)
    if vram_budget is not None and not disable_gpu_index:
        click.echo(offload(model, model_path, vram_budget, activation_dir, reset_gpu_index), err=True)
    ids = tok.encode(prompt)
    if len(ids) >= model.n_ctx:
        raise PowerInferError(f"prompt: {len(ids)} tokens do not fit the context length {model.n_ctx} "
                              "(shorten it or raise -c up to the model's context length)")
    stream = TextStream(tok)
    out = sys.stdout
    out.write(prompt)
    out.flush()

    def on_token(t: int) -> None:
        out.write(stream.push(t))
        out.flush()

    st = generate(model, ids, n_predict, SamplerSettings(temp, top_k, top_p, seed), tok.eos_id, on_token)
    out.write("\n")
    mode = "dense" if model.dense else "sparse"
    err = sys.stderr
    err.write(f"\nmodel: {model_path} ({model.args.family.name}, {mode}, {dtype}, {torch.get_num_threads()} threads)\n")
    err.write(f"prompt eval: {st.n_prompt} tokens in {st.t_prompt * 1e3:.1f} ms ({st.prompt_tps:.1f} tokens/s)\n")
    err.write(f"generation:  {st.n_gen} tokens, {st.n_eval} evals in {st.t_gen * 1e3:.1f} ms ({st.gen_tps:.1f} tokens/s)\n")
    if st.active_share is not None:
        err.write(f"FFN neurons computed: {100 * st.active_share:.1f}% of n_ff on average (predicted active)\n")


if __name__ == "__main__":
    main()
