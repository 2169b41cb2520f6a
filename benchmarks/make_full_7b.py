"""Write a full Llama-2-7B-shaped ReLU model (random bf16 weights) as sharded HF safetensors.

The calibration stages (``pi-profile``, ``pi-train-predictor``) stream a model one
decoder layer at a time from its checkpoint shards; this makes the full-size input
for benchmarking them (``bench_calibration.py``) without a download:

* ``config.json``: ``LlamaForCausalLM`` with ``hidden_act: relu`` (n_embd 4096,
  n_ff 11008, 32 heads, 32 kv heads, vocab 32000, 4096 positions, rms_norm_eps 1e-5),
  written by transformers' ``LlamaConfig.save_pretrained``;
* ``model-0000i-of-0000N.safetensors`` + ``model.safetensors.index.json``
  (``metadata.total_size``, ``weight_map``): tensors in the order and with the names
  ``save_pretrained`` uses, cut greedily into shards of at most ``--shard-gb`` GB
  (10^9 bytes) as huggingface_hub does; ~13.5 GB in 7 shards by default;
* ``tokenizer.model`` + ``tokenizer_config.json``: the Llama-2 SentencePiece tokenizer
  (from ``tests/data/tokenizers/llama2``, as ``make_bench_model.py`` copies).

The model is never built in memory: each tensor is drawn in row blocks and written
straight into its shard file (the safetensors header is known up front from the
shapes), so peak memory stays at a few hundred MB. Weights: matrices are
N(0, 1/fan_in) so every projection of an RMS-normed input has O(1) entries and the
residual stream stays O(1)-ish through 32 layers; norm weights are 1; the token
embeddings are N(0, 1). Every tensor has its own ``torch.Generator`` seeded from
``--seed`` and its name, so reruns (and other ``--shard-gb``) give identical weights.

Files are written under a temporary name and renamed when complete, and the index
last: a rerun skips shards already present with the right size, and does nothing when
the index and all shards are there.

    python benchmarks/make_full_7b.py out/full7b                  # ~13.5 GB, a few minutes
    python benchmarks/make_full_7b.py out/full7b-2l --n-layer 2   # a quick 2-layer check
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import struct
import time
import zlib
from dataclasses import dataclass
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
TOKENIZER = ROOT / "tests" / "data" / "tokenizers" / "llama2"
TOKENIZER_FILES = ("tokenizer.model", "tokenizer_config.json")
INDEX = "model.safetensors.index.json"
BYTES = 2  # bf16
ROWS_PER_BLOCK = 4096  # rows drawn at once (4096 x 11008 f32 = 180 MB)


@dataclass
class Spec:
    name: str
    shape: tuple[int, ...]
    kind: str  # "matrix" (std 1/sqrt(fan_in)), "embed" (std 1), "norm" (ones)

    @property
    def nbytes(self) -> int:
        n = BYTES
        for d in self.shape:
            n *= d
        return n


def tensor_specs(n_layer: int, n_embd: int, n_ff: int, n_head: int, n_kv_head: int, n_vocab: int) -> list[Spec]:
    """All tensors of a ``LlamaForCausalLM`` in ``state_dict`` order (what ``save_pretrained`` shards)."""
    kv = n_embd // n_head * n_kv_head
    specs = [Spec("model.embed_tokens.weight", (n_vocab, n_embd), "embed")]
    for i in range(n_layer):
        p = f"model.layers.{i}."
        specs += [
            Spec(p + "self_attn.q_proj.weight", (n_embd, n_embd), "matrix"),
            Spec(p + "self_attn.k_proj.weight", (kv, n_embd), "matrix"),
            Spec(p + "self_attn.v_proj.weight", (kv, n_embd), "matrix"),
            Spec(p + "self_attn.o_proj.weight", (n_embd, n_embd), "matrix"),
            Spec(p + "mlp.gate_proj.weight", (n_ff, n_embd), "matrix"),
            Spec(p + "mlp.up_proj.weight", (n_ff, n_embd), "matrix"),
            Spec(p + "mlp.down_proj.weight", (n_embd, n_ff), "matrix"),
            Spec(p + "input_layernorm.weight", (n_embd,), "norm"),
            Spec(p + "post_attention_layernorm.weight", (n_embd,), "norm"),
        ]
    specs += [Spec("model.norm.weight", (n_embd,), "norm"), Spec("lm_head.weight", (n_vocab, n_embd), "matrix")]
    return specs


def plan_shards(specs: list[Spec], max_bytes: int) -> list[list[Spec]]:
    """Greedy split as huggingface_hub's ``split_torch_state_dict_into_shards``."""
    shards: list[list[Spec]] = []
    cur: list[Spec] = []
    size = 0
    for s in specs:
        if s.nbytes > max_bytes:  # larger than a shard: a shard of its own
            shards.append([s])
            continue
        if cur and size + s.nbytes > max_bytes:
            shards.append(cur)
            cur, size = [], 0
        cur.append(s)
        size += s.nbytes
    if cur:
        shards.append(cur)
    return shards


def shard_header(specs: list[Spec]) -> bytes:
    """The safetensors prefix: u64 little-endian header length + JSON header padded with spaces to 8 bytes."""
    header: dict = {"__metadata__": {"format": "pt"}}
    off = 0
    for s in specs:
        header[s.name] = {"dtype": "BF16", "shape": list(s.shape), "data_offsets": [off, off + s.nbytes]}
        off += s.nbytes
    js = json.dumps(header, separators=(",", ":")).encode()
    js += b" " * (-len(js) % 8)
    return struct.pack("<Q", len(js)) + js


def shard_file_size(specs: list[Spec]) -> int:
    return len(shard_header(specs)) + sum(s.nbytes for s in specs)


def write_tensor(f, spec: Spec, seed: int) -> None:
    """Draw ``spec`` block by block (bf16) and append its bytes to ``f``."""
    if spec.kind == "norm":
        f.write(torch.ones(spec.shape, dtype=torch.bfloat16).view(torch.uint8).numpy().tobytes())
        return
    gen = torch.Generator().manual_seed(seed * 1_000_003 + zlib.crc32(spec.name.encode()))
    rows, cols = spec.shape
    std = 1.0 if spec.kind == "embed" else cols ** -0.5
    for r0 in range(0, rows, ROWS_PER_BLOCK):
        block = torch.randn((min(ROWS_PER_BLOCK, rows - r0), cols), generator=gen)
        block = block.mul_(std).to(torch.bfloat16)
        f.write(block.view(torch.uint8).numpy().data)


def write_shard(path: Path, specs: list[Spec], seed: int) -> None:
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "wb") as f:
        f.write(shard_header(specs))
        for s in specs:
            write_tensor(f, s, seed)
    if tmp.stat().st_size != shard_file_size(specs):
        raise RuntimeError(f"{tmp}: wrote {tmp.stat().st_size} bytes, expected {shard_file_size(specs)}")
    os.replace(tmp, path)


def shard_names(n: int) -> list[str]:
    return [f"model-{i + 1:05d}-of-{n:05d}.safetensors" for i in range(n)]


def is_complete(out: Path, shards: list[list[Spec]]) -> bool:
    """OUT holds this exact model: the index names these shards and each has its expected size."""
    index = out / INDEX
    if not (index.is_file() and (out / "config.json").is_file()):
        return False
    try:
        weight_map = json.loads(index.read_text())["weight_map"]
    except (ValueError, KeyError):
        return False
    names = shard_names(len(shards))
    if weight_map != {s.name: fn for fn, sh in zip(names, shards) for s in sh}:
        return False
    return all((out / fn).is_file() and (out / fn).stat().st_size == shard_file_size(sh)
               for fn, sh in zip(names, shards))


def write_config(out: Path, n_layer: int, n_embd: int, n_ff: int, n_head: int, n_kv_head: int, n_vocab: int,
                 n_ctx: int) -> None:
    from transformers import LlamaConfig

    cfg = LlamaConfig(vocab_size=n_vocab, hidden_size=n_embd, intermediate_size=n_ff, num_hidden_layers=n_layer,
                      num_attention_heads=n_head, num_key_value_heads=n_kv_head, hidden_act="relu",
                      max_position_embeddings=n_ctx, rms_norm_eps=1e-5, bos_token_id=1, eos_token_id=2,
                      tie_word_embeddings=False, dtype="bfloat16")
    cfg.architectures = ["LlamaForCausalLM"]
    cfg.save_pretrained(out)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("out", help="output folder (e.g. out/full7b)")
    ap.add_argument("--n-layer", type=int, default=32)
    ap.add_argument("--n-embd", type=int, default=4096)
    ap.add_argument("--n-ff", type=int, default=11008)
    ap.add_argument("--n-head", type=int, default=32)
    ap.add_argument("--n-kv-head", type=int, default=32)
    ap.add_argument("--n-vocab", type=int, default=32000)
    ap.add_argument("--n-ctx", type=int, default=4096, help="max_position_embeddings")
    ap.add_argument("--shard-gb", type=float, default=2.0, help="maximum shard size in GB (10^9 bytes)")
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args(argv)

    out = Path(a.out)
    specs = tensor_specs(a.n_layer, a.n_embd, a.n_ff, a.n_head, a.n_kv_head, a.n_vocab)
    shards = plan_shards(specs, int(a.shard_gb * 1e9))
    names = shard_names(len(shards))
    total = sum(s.nbytes for s in specs)
    if is_complete(out, shards):
        print(f"{out}: complete ({len(shards)} shards, {total / 1e9:.2f} GB), nothing to do")
        return
    out.mkdir(parents=True, exist_ok=True)
    (out / INDEX).unlink(missing_ok=True)  # written again last, when every shard is in place
    for stale in out.glob("model-*.safetensors*"):  # other shard counts or interrupted writes
        if stale.name not in names:
            stale.unlink()
    write_config(out, a.n_layer, a.n_embd, a.n_ff, a.n_head, a.n_kv_head, a.n_vocab, a.n_ctx)
    for name in TOKENIZER_FILES:
        shutil.copy(TOKENIZER / name, out / name)
        (out / name).chmod(0o644)

    print(f"{out}: {a.n_layer} layers, {len(specs)} tensors, {total / 1e9:.2f} GB bf16 in {len(shards)} shards")
    t0 = time.time()
    for k, (fn, sh) in enumerate(zip(names, shards)):
        path = out / fn
        size = shard_file_size(sh)
        t1 = time.time()
        if path.is_file() and path.stat().st_size == size:
            print(f"[{k + 1}/{len(shards)}] {fn}: present ({size / 1e9:.2f} GB), kept", flush=True)
            continue
        write_shard(path, sh, a.seed)
        dt = time.time() - t1
        print(f"[{k + 1}/{len(shards)}] {fn}: {len(sh)} tensors, {size / 1e9:.2f} GB, {dt:.1f} s "
              f"({size / 1e6 / max(dt, 1e-9):.0f} MB/s)", flush=True)
    index = {"metadata": {"total_parameters": total // BYTES, "total_size": total},
             "weight_map": {s.name: fn for fn, sh in zip(names, shards) for s in sh}}
    tmp = out / (INDEX + ".tmp")
    tmp.write_text(json.dumps(index, indent=2, sort_keys=True) + "\n")
    os.replace(tmp, out / INDEX)
    print(f"done: {total / 1e9:.2f} GB in {len(shards)} shards, {time.time() - t0:.0f} s")


if __name__ == "__main__":
    main()
