"""The device check for GPU offload (issue 13), in one call of at most 10 minutes on a GPU machine.

1. the CUDA tests (``tests/test_hybrid.py -k test_cuda_``: every family offloaded at 0%, one layer,
   dense + half the neurons and 100%, f16 on the GPU against the f32 CPU run; KV cache and
   weights on the GPU; a budget above free VRAM clamped);
2. pi-run decode tokens/s on the 7B-shaped benchmark model (``make_bench_model.py``: Llama-2-7B
   layer shape, 4 layers, f16, ~10% of neurons predicted active; built if missing) at VRAM
   budgets of 0, 25, 50, 75 and 100% of the model's bytes (every tensor but the token
   embedding, plus an f16 KV cache for ``-c`` tokens), with what each budget placed;
3. llama.cpp (``llama-cpp-python`` built with CUDA) on the dense file at the same VRAM, as
   whole layers (``n_gpu_layers``: the layers, with their KV cache, that fit; the output
   too once every layer does), where it is importable with GPU offload.

It prints one table. Without CUDA it runs the same steps with the device side forced onto the
CPU (``device="cpu"``, as ``POWERINFER_OFFLOAD_DEVICE=cpu`` does for pi-run) and says so in
its header: those figures are CPU figures, not GPU ones (and the device side then holds the
weights in the CPU's compute dtype, f32 or bf16, so its MB are not the GPU's f16 MB). ``--smoke`` uses a 2-layer toy model built in a temporary folder.

    python benchmarks/gpu_check.py                  # on the GPU machine (out/bench is built if missing)
    python benchmarks/gpu_check.py --smoke          # anywhere: checks the script itself

The model is built from files in the repository: the Llama-2 tokenizer in
``tests/data/tokenizers/llama2`` and the TinyStories text ``tests/data/text/tinystories_sample.txt``.
"""
from __future__ import annotations

import argparse
import gc
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from powerinfer.convert.gpu_index import GIB, dense_vram_bytes  # noqa: E402
from powerinfer.formats.gguf_file import open_gguf  # noqa: E402
from powerinfer.runtime.generate import SamplerSettings, generate  # noqa: E402
from powerinfer.runtime.hybrid import offload, placement_lines  # noqa: E402
from powerinfer.runtime.model import Transformer  # noqa: E402
from powerinfer.runtime.tokenizer import GGUFTokenizer  # noqa: E402
from powerinfer.runtime.weights import compute_dtype  # noqa: E402

FFN_ROWS = (".ffn_gate.weight", ".ffn_up.weight", ".ffn_down_t.weight")
PROMPT = "Once upon a time, there was a little girl named Lily. She loved to play outside in the park."


def run_cuda_tests(timeout: float) -> str:
    """The hybrid tests named ``test_cuda_*`` (skipped without CUDA); pytest's summary line."""
    try:
        r = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "tests/test_hybrid.py",
                            "-k", "test_cuda_", "-rs"], cwd=ROOT, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return f"timed out after {timeout:.0f} s"
    lines = [ln for ln in r.stdout.strip().splitlines() if ln.strip()]
    if r.returncode not in (0, 5):
        print(r.stdout[-4000:], file=sys.stderr)
    return lines[-1].strip("= ") if lines else f"pytest exited {r.returncode}: {r.stderr.strip()[-300:]}"


def build_model(out: Path, tiny: bool) -> Path:
    """``out/bench.powerinfer.gguf`` (and ``bench.gguf``, ``activation/``), built when missing."""
    if not (out / "bench.powerinfer.gguf").is_file() or not (out / "bench.gguf").is_file():
        cmd = [sys.executable, str(ROOT / "benchmarks" / "make_bench_model.py"), str(out)] + (["--tiny"] if tiny else [])
        print("building the benchmark model:", " ".join(cmd), file=sys.stderr)
        subprocess.run(cmd, cwd=ROOT, check=True)
    return out


def model_bytes(path: Path, n_ctx: int) -> int:
    """Every byte a GPU holding the whole model needs: the GPU index's dense size (non-FFN
    tensors but the token embedding, f16 KV cache) plus every FFN neuron's rows."""
    g = open_gguf(path)
    return dense_vram_bytes(g, n_ctx) + sum(int(t.n_bytes) for t in g.reader.tensors if t.name.endswith(FFN_ROWS))


def pi_run(path: Path, budget: int, n_ctx: int, n: int, device: str) -> dict:
    """Decode ``n`` tokens greedily after offloading with ``budget`` bytes."""
    g = open_gguf(path)
    model, ids = Transformer(g, compute_dtype("auto"), n_ctx=n_ctx), GGUFTokenizer(g).encode(PROMPT)
    t0 = time.perf_counter()
    summary = offload(model, path, budget / GIB, device=device) or "nothing placed"
    t_place = time.perf_counter() - t0
    generate(model, ids, 4, SamplerSettings(temp=0.0))  # warm-up: kernels, CUDA context, caches
    st = generate(model, ids, n, SamplerSettings(temp=0.0))
    pl = model.placement
    row = {"tps": st.gen_tps, "place_s": t_place, "summary": summary, "lines": placement_lines(model, st.n_eval),
           "dev_mb": (pl.bytes["device"] + pl.kv_bytes["device"]) / 1e6 if pl else 0.0,
           "layers": f"{pl.n_layers}/{len(model.layers)}" if pl else "0",
           "neurons": pl.n_gpu_neurons / max(1, pl.n_neurons) if pl else 0.0}
    del model
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    return row


def llama_layers(dense: Path, budget: int, n_ctx: int) -> int:
    """llama.cpp's ``n_gpu_layers`` for ``budget`` bytes: whole layers (all their tensors and an f16
    KV cache slice) from the first, then the output (n_layer + 1) once every layer fits."""
    g = open_gguf(dense)
    a = g.arch
    L, D = int(g.require(f"{a}.block_count")), int(g.require(f"{a}.embedding_length"))
    H = int(g.require(f"{a}.attention.head_count"))
    Hkv = int(g.get(f"{a}.attention.head_count_kv", H))
    per = [2 * n_ctx * Hkv * (D // H) * 2] * L
    rest = 0
    for t in g.reader.tensors:
        if t.name.startswith("blk."):
            per[int(t.name.split(".")[1])] += int(t.n_bytes)
        elif t.name != "token_embd.weight":
            rest += int(t.n_bytes)
    k, left = 0, budget
    while k < L and per[k] <= left:
        left -= per[k]
        k += 1
    return k + 1 if k == L and rest <= left else k


def llama_cpp_run(dense: Path, n_gpu_layers: int, n_ctx: int, n: int) -> float:
    """Greedy decode tokens/s of llama.cpp with ``n_gpu_layers`` on the GPU (argmax of its logits)."""
    import numpy as np
    import llama_cpp

    llm = llama_cpp.Llama(model_path=str(dense), n_ctx=n_ctx, n_gpu_layers=n_gpu_layers, n_batch=512,
                          n_threads=torch.get_num_threads(), verbose=False)
    try:
        n_vocab = llm.n_vocab()
        logits = lambda: np.ctypeslib.as_array(llama_cpp.llama_get_logits_ith(llm.ctx, -1), shape=(n_vocab,))  # noqa
        llm.reset()
        llm.eval(llm.tokenize(PROMPT.encode()))
        for _ in range(4):  # warm-up
            llm.eval([int(logits().argmax())])
        t0 = time.perf_counter()
        for _ in range(n):
            llm.eval([int(logits().argmax())])
        return n / (time.perf_counter() - t0)
    finally:
        llm.close()


def llama_cpp_status(cuda: bool) -> str | None:
    """None when llama.cpp can run with GPU offload here, else why not (or why it runs on the CPU)."""
    try:
        import llama_cpp
    except ImportError:
        return "llama-cpp-python not installed"
    if not llama_cpp.llama_supports_gpu_offload():
        return "llama-cpp-python built without GPU offload (CMAKE_ARGS=-DGGML_CUDA=on pip install llama-cpp-python)"
    return None if cuda else "no CUDA device"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default="out/bench", help="benchmark model folder (default out/bench; built if missing)")
    ap.add_argument("--smoke", action="store_true", help="a 2-layer toy model in a temporary folder, 8 tokens")
    ap.add_argument("-n", type=int, default=64, help="tokens decoded per run (default 64)")
    ap.add_argument("-c", "--ctx", type=int, default=512, help="context length for both engines (default 512)")
    ap.add_argument("--budgets", default="0,25,50,75,100", help="percent of the model's bytes")
    ap.add_argument("--skip-tests", action="store_true")
    ap.add_argument("--deadline", type=float, default=540, help="seconds after which remaining runs are skipped")
    a = ap.parse_args(argv)
    t_start = time.perf_counter()
    cuda = torch.cuda.is_available()
    device = "cuda" if cuda else "cpu"
    where = torch.cuda.get_device_name(0) if cuda else "no CUDA: device side forced onto the CPU (CPU figures)"
    n = 8 if a.smoke else a.n
    tmp = tempfile.TemporaryDirectory() if a.smoke else None
    out = Path(tmp.name) if tmp else (ROOT / a.out if not Path(a.out).is_absolute() else Path(a.out))
    tests = "skipped (--skip-tests)" if a.skip_tests else run_cuda_tests(max(60.0, a.deadline / 3))
    build_model(out, tiny=a.smoke)
    sparse, dense = out / "bench.powerinfer.gguf", out / "bench.gguf"
    total = model_bytes(sparse, a.ctx)
    why_not_llama = llama_cpp_status(cuda)
    rows = []
    for pct in [float(p) for p in a.budgets.split(",")]:
        budget = int(total * pct / 100)
        if time.perf_counter() - t_start > a.deadline:
            rows.append((pct, budget, None, None, "skipped: past the deadline"))
            continue
        r = pi_run(sparse, budget, a.ctx, n, device)
        llama = None
        if why_not_llama is None and time.perf_counter() - t_start <= a.deadline:
            k = llama_layers(dense, budget, a.ctx)
            llama = (k, llama_cpp_run(dense, k, a.ctx, n))
        rows.append((pct, budget, r, llama, ""))
        print(f"{pct:.0f}%: {r['summary']}", file=sys.stderr)
        for line in r["lines"]:
            print(line, file=sys.stderr)
    print(f"\nGPU check: {where}; torch {torch.__version__}; model {sparse} "
          f"({total / 1e6:.1f} MB with a {a.ctx}-token f16 KV cache); {n} tokens greedy per run")
    print(f"CUDA tests: {tests}")
    print(f"llama.cpp: {why_not_llama or 'llama-cpp-python with GPU offload'}")
    print(f"{'budget':>7} {'MiB':>8} | {'pi-run tok/s':>12} {'placed MB':>9} {'layers':>6} {'neurons':>7} | "
          f"{'llama.cpp tok/s':>15} {'ngl':>4} | {'pi/llama':>8}")
    for pct, budget, r, llama, note in rows:
        if r is None:
            print(f"{pct:>6.0f}% {budget / 2**20:>8.1f} | {note}")
            continue
        lt, ngl, ratio = "n/a", "", ""
        if llama is not None:
            ngl, lt = str(llama[0]), f"{llama[1]:.1f}"
            ratio = f"{r['tps'] / llama[1]:.2f}x"
        print(f"{pct:>6.0f}% {budget / 2**20:>8.1f} | {r['tps']:>12.1f} {r['dev_mb']:>9.1f} {r['layers']:>6} "
              f"{100 * r['neurons']:>6.1f}% | {lt:>15} {ngl:>4} | {ratio:>8}")
    print(f"(done in {time.perf_counter() - t_start:.0f} s)")
    if tmp:
        tmp.cleanup()
    return 0 if ("failed" not in tests and "error" not in tests) else 1


if __name__ == "__main__":
    sys.exit(main())
