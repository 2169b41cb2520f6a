#!/usr/bin/env python3
"""Relufication recipe: turn a SiLU Llama into a ReLU-sparse (ReGLU) Llama.

What it does
------------
Takes a Hugging Face ``LlamaForCausalLM`` checkpoint with ``hidden_act: silu`` (SwiGLU FFN)
and produces a checkpoint with ``hidden_act: relu``, i.e. the FFN becomes

    down(relu(gate x) * up x)          (ReGLU, the ReluLLaMA / PowerInfer layout)

so that FFN neuron ``j`` of a layer is inactive whenever ``gate_j(x) <= 0``. Swapping the
activation alone hurts the model, so the swapped model is fine-tuned with

* next-token cross-entropy on the training text,
* a distillation term ``T^2 * KL(p_teacher^T || p_student^T)`` against the logits of the
  frozen original SiLU model (the teacher), as ReluLLaMA did to keep quality, and
* an L1 penalty on the FFN activations ``relu(gate x)`` (mean over tokens, neurons and
  layers) whose coefficient rises progressively from 0 to ``--l1-max`` over the first
  ``--l1-ramp`` fraction of training (a sine-shaped ramp) and is then held, following
  ProSparse's progressive sparsity regularisation. The final stretch of training runs with
  the L1 coefficient held and a decaying learning rate, so quality recovers at the target
  sparsity.

Only transformers' own ``LlamaForCausalLM`` is used (no ``trust_remote_code``); every shape is
read from the base model's config, so the recipe runs on any SiLU Llama the machine can
fine-tune.

Papers followed
---------------
* Mirzadeh et al., "ReLU Strikes Back: Exploiting Activation Sparsity in Large Language
  Models" (2023): relufication, i.e. replace SiLU by ReLU and fine-tune; and SparseLLM's
  ReluLLaMA-7B/13B, made the same way (with distillation) and run by PowerInfer.
* Song et al., "ProSparse: Introducing and Enhancing Intrinsic Activation Sparsity within
  Large Language Models" (2024): ReLU substitution plus a progressively increasing L1
  penalty on the FFN activations. (ProSparse's last step, a FATReLU threshold, is not used:
  the output keeps plain ``relu`` so that "active" means ``gate(x) > 0`` exactly.)

Data protocol (fixed; the bundled model was made this way)
----------------------------------------------------------
1. The text file is split on blank lines into chunks (``text.split("\\n\\n")``, each chunk
   stripped, empty ones dropped). For TinyStories a chunk is a story or a paragraph of one:
   the exported file separates paragraphs inside a story with blank lines too, so story
   boundaries are not recoverable.
2. The last ``--heldout-frac`` (default 10%) of the chunks, by count and in file order, is the
   held-out set, used for evaluation ONLY (never for training, monitoring or model
   selection). The rest, in file order, is the training set. (At most one story straddles the
   boundary.)
3. Every chunk is tokenized with the base model's own tokenizer
   (``AutoTokenizer.from_pretrained(base)``, BOS-prefixed, no EOS); the token lists of each
   set are concatenated into one stream.
4. Held-out: the stream is cut into consecutive non-overlapping sequences of ``--seq-len``
   (256) tokens; the incomplete tail is dropped. Both the SiLU original and the ReLU result
   are evaluated on exactly these sequences: loss = mean next-token cross-entropy in nats
   over every predicted position (seq_len - 1 per sequence); sparsity = share of
   (token, layer, neuron) triples with ``gate_proj(x) <= 0`` over every token, per layer and
   averaged over layers.
5. Training: each batch holds ``--batch-size`` windows of ``--seq-len`` tokens taken at
   uniformly random offsets of the training stream (a seeded generator).
6. The default hyper-parameters were chosen on a development split carved from the
   TRAINING part only (the same protocol applied to the training chunks, i.e. its last 10%
   as dev set); held-out numbers were not used to choose them.
7. Everything is seeded (``--seed``) and the thread count is fixed (``--threads``), so a
   re-run on the same machine reproduces the numbers (bit-exactness across machines or
   torch versions is not promised).

Output
------
``OUT`` gets a Hugging Face layout: ``config.json`` (``hidden_act: relu``, fp32),
``model.safetensors`` (fp32; tied embeddings stay tied as in the base), ``generation_config.json``,
the tokenizer files copied from the base, and ``relufy_report.json`` (losses, relative
increase, per-layer and mean sparsity, held-out token counts, steps, hyper-parameters, wall
time, a greedy sample). The directory is written into a temporary sibling and renamed into
place, so a crash never leaves a half-written model at ``OUT``. The reported ReLU numbers are
measured on the model re-loaded from the written files.

Optionally (``--calibration-out``) the recipe also writes a calibration text cut from the
start of the TRAINING chunks (never the held-out ones), for activation profiling and
predictor training.

Example (the command that produced ``powerinfer/assets/stories260K-relu``)::

    python recipes/relufy.py --base tests/data/stories260K/hf \\
        --data tests/data/text/tinystories_val.txt \\
        --out powerinfer/assets/stories260K-relu \\
        --steps 2400 --l1-max 7 --l1-ramp 0.6 --kl-weight 1 --kl-temp 1 --lr 2e-3 \\
        --seed 1234 --threads 2 \\
        --calibration-out powerinfer/assets/calibration.txt

``tests/data/stories260K/hf`` is Karpathy's stories260K (karpathy/tinyllamas, llama2.c) in
Hugging Face layout and ``tests/data/text/tinystories_val.txt`` the start of TinyStories'
validation split (roneneldan/TinyStories); sources, licences and sha256s in
``tests/data/README.md``. The run that made the asset read copies of the same bytes kept
outside the repository, whose paths its ``relufy_report.json`` records.
"""

from __future__ import annotations

import json
import math
import os
import random
import shutil
import tempfile
import time
from pathlib import Path

import click
import numpy as np
import torch
import torch.nn.functional as F
from tqdm import tqdm
from transformers import AutoTokenizer, LlamaForCausalLM

TOKENIZER_FILES = (
    "tokenizer.model",
    "tokenizer_config.json",
    "tokenizer.json",
    "special_tokens_map.json",
    "added_tokens.json",
)


# ----------------------------------------------------------------------------- data


def split_chunks(text: str) -> list[str]:
    """Blank-line separated chunks, stripped, empties dropped, in file order."""
    text = text.replace("\r\n", "\n")
    return [c.strip() for c in text.split("\n\n") if c.strip()]


def split_train_heldout(chunks: list[str], heldout_frac: float) -> tuple[list[str], list[str]]:
    n_held = max(1, int(round(len(chunks) * heldout_frac)))
    if n_held >= len(chunks):
        raise click.UsageError("--heldout-frac leaves no training text")
    return chunks[:-n_held], chunks[-n_held:]


def token_stream(tokenizer, chunks: list[str], bos_id: int | None) -> torch.Tensor:
    ids: list[int] = []
    for enc in tokenizer(chunks, add_special_tokens=False)["input_ids"]:
        if bos_id is not None:
            ids.append(bos_id)
        ids.extend(enc)
    return torch.tensor(ids, dtype=torch.long)


def pack(stream: torch.Tensor, seq_len: int) -> torch.Tensor:
    n = stream.numel() // seq_len
    return stream[: n * seq_len].view(n, seq_len)


# ----------------------------------------------------------------------------- hooks


class GateRecorder:
    """Forward hooks on every layer's ``mlp.gate_proj``; keeps the pre-activations."""

    def __init__(self, model: LlamaForCausalLM):
        self.outputs: list[torch.Tensor | None] = [None] * len(model.model.layers)
        self.handles = [
            layer.mlp.gate_proj.register_forward_hook(self._hook(i))
            for i, layer in enumerate(model.model.layers)
        ]

    def _hook(self, i: int):
        def fn(_module, _inp, out):
            self.outputs[i] = out

        return fn

    def clear(self) -> None:
        self.outputs = [None] * len(self.outputs)

    def remove(self) -> None:
        for h in self.handles:
            h.remove()


# ----------------------------------------------------------------------------- eval


@torch.no_grad()
def evaluate(model: LlamaForCausalLM, seqs: torch.Tensor, batch_size: int) -> dict:
    """Mean next-token loss (nats) and per-layer share of gate_proj(x) <= 0 on ``seqs``."""
    model.eval()
    rec = GateRecorder(model)
    n_layers = len(model.model.layers)
    inactive = torch.zeros(n_layers, dtype=torch.float64)
    gate_total = 0
    nll_sum = 0.0
    n_targets = 0
    try:
        for s in range(0, seqs.shape[0], batch_size):
            x = seqs[s : s + batch_size]
            logits = model(input_ids=x, use_cache=False).logits
            nll = F.cross_entropy(
                logits[:, :-1].reshape(-1, logits.shape[-1]).double(),
                x[:, 1:].reshape(-1),
                reduction="sum",
            )
            nll_sum += nll.item()
            n_targets += x[:, 1:].numel()
            for i, g in enumerate(rec.outputs):
                inactive[i] += (g <= 0).sum().item()
            gate_total += rec.outputs[0].numel()
            rec.clear()
    finally:
        rec.remove()
    per_layer = (inactive / gate_total).tolist()
    return {
        "loss": nll_sum / n_targets,
        "sparsity_per_layer": per_layer,
        "sparsity_mean": float(sum(per_layer) / n_layers),
        "n_loss_targets": n_targets,
        "n_tokens": int(seqs.numel()),
    }


@torch.no_grad()
def greedy_sample(model, tokenizer, prompt: str, max_new_tokens: int) -> str:
    model.eval()
    enc = tokenizer(prompt, return_tensors="pt")
    out = model.generate(
        **enc, do_sample=False, max_new_tokens=max_new_tokens, pad_token_id=tokenizer.eos_token_id
    )
    return tokenizer.decode(out[0], skip_special_tokens=True)


# ----------------------------------------------------------------------------- schedules


def lr_at(step: int, steps: int, lr: float, warmup: int, min_lr_frac: float) -> float:
    if step < warmup:
        return lr * (step + 1) / warmup
    t = (step - warmup) / max(1, steps - warmup)
    return lr * (min_lr_frac + (1 - min_lr_frac) * 0.5 * (1 + math.cos(math.pi * t)))


def l1_at(step: int, steps: int, l1_max: float, ramp_frac: float) -> float:
    """ProSparse-style progressive L1 factor: 0 -> l1_max along a sine quarter-wave, then held."""
    ramp = max(1, int(round(steps * ramp_frac)))
    if step >= ramp:
        return l1_max
    return l1_max * math.sin(0.5 * math.pi * step / ramp)


# ----------------------------------------------------------------------------- output


def _write_config_compat(path: Path, base_config: dict) -> None:
    """Make config.json readable by both transformers 5 and older readers (converters)."""
    cfg = json.loads(path.read_text())
    cfg["hidden_act"] = "relu"
    cfg["torch_dtype"] = "float32"
    cfg["dtype"] = "float32"
    rope = cfg.get("rope_parameters") or {}
    if "rope_theta" not in cfg:
        if "rope_theta" in rope:
            cfg["rope_theta"] = rope["rope_theta"]
        elif "rope_theta" in base_config:
            cfg["rope_theta"] = base_config["rope_theta"]
    path.write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")


def _install_dir(tmp: Path, out: Path) -> None:
    """Rename ``tmp`` to ``out``; an existing ``out`` is swapped out first, then deleted."""
    old = None
    if out.exists():
        old = out.with_name(f".{out.name}.old-{os.getpid()}")
        os.rename(out, old)
    try:
        os.rename(tmp, out)
    except BaseException:
        if old is not None:
            os.rename(old, out)
        raise
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


# ----------------------------------------------------------------------------- main


@click.command(context_settings={"show_default": True})
@click.option("--base", "base_dir", required=True, type=click.Path(exists=True, file_okay=False),
              help="HF dir of the SiLU LlamaForCausalLM (with its tokenizer).")
@click.option("--data", "data_path", required=True, type=click.Path(exists=True, dir_okay=False),
              help="Plain text, chunks separated by blank lines.")
@click.option("--out", "out_dir", required=True, type=click.Path(file_okay=False),
              help="Output HF dir (written atomically).")
@click.option("--steps", default=2400, help="Optimizer steps.")
@click.option("--batch-size", default=16, help="Training sequences per step.")
@click.option("--seq-len", default=256, help="Tokens per packed sequence (train and eval).")
@click.option("--lr", default=2e-3, help="Peak AdamW learning rate.")
@click.option("--min-lr-frac", default=0.05, help="Final LR as a fraction of --lr (cosine decay).")
@click.option("--warmup", default=100, help="Linear LR warm-up steps.")
@click.option("--weight-decay", default=0.0, help="AdamW weight decay.")
@click.option("--grad-clip", default=1.0, help="Max gradient norm (0 = off).")
@click.option("--l1-max", default=7.0, help="Final coefficient of the L1 penalty on relu(gate x).")
@click.option("--l1-ramp", default=0.6, help="Fraction of steps over which the L1 coefficient ramps up.")
@click.option("--kl-weight", default=1.0, help="Weight of the distillation KL against the SiLU teacher.")
@click.option("--kl-temp", default=1.0, help="Distillation temperature T (KL is scaled by T^2).")
@click.option("--ce-weight", default=1.0, help="Weight of the next-token cross-entropy on the data.")
@click.option("--heldout-frac", default=0.1, help="Share of chunks (the last ones) held out for evaluation.")
@click.option("--eval-batch-size", default=16, help="Sequences per evaluation forward.")
@click.option("--seed", default=1234, help="Seed for torch, numpy, random and batch sampling.")
@click.option("--threads", default=2, help="torch.set_num_threads.")
@click.option("--sample-prompt", default="Once upon a time", help="Prompt of the greedy sample in the report.")
@click.option("--sample-tokens", default=80, help="New tokens of the greedy sample.")
@click.option("--calibration-out", type=click.Path(dir_okay=False), default=None,
              help="Also write a calibration text cut from the start of the TRAINING chunks.")
@click.option("--calibration-bytes", default=120_000, help="Approximate size of --calibration-out.")
@click.option("--force", is_flag=True,
              help="Replace --out even if it exists and does not look like a previous relufy output.")
def main(base_dir, data_path, out_dir, steps, batch_size, seq_len, lr, min_lr_frac, warmup,
         weight_decay, grad_clip, l1_max, l1_ramp, kl_weight, kl_temp, ce_weight, heldout_frac,
         eval_batch_size, seed, threads, sample_prompt, sample_tokens, calibration_out,
         calibration_bytes, force):
    """Relufy a SiLU Llama: ReLU swap + progressive-L1 + distillation fine-tune."""
    t_start = time.time()
    base = Path(base_dir)
    out = Path(out_dir).resolve()
    if out.exists() and not force:
        contents = set(os.listdir(out))
        if contents and "relufy_report.json" not in contents:
            raise click.UsageError(f"{out} exists and is not a relufy output; pass --force to replace it")

    torch.set_num_threads(threads)
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)

    # ---- models
    base_config = json.loads((base / "config.json").read_text())
    if base_config.get("model_type") != "llama":
        raise click.UsageError(f"expected a llama model, got model_type={base_config.get('model_type')!r}")
    tokenizer = AutoTokenizer.from_pretrained(base)
    teacher = LlamaForCausalLM.from_pretrained(base, dtype=torch.float32).eval()
    for p in teacher.parameters():
        p.requires_grad_(False)
    if teacher.config.hidden_act not in ("silu", "swish"):
        click.echo(f"warning: base hidden_act is {teacher.config.hidden_act!r}, not silu", err=True)
    student = LlamaForCausalLM.from_pretrained(base, dtype=torch.float32)
    student.config.hidden_act = "relu"
    for layer in student.model.layers:  # same module the config would build
        layer.mlp.act_fn = torch.nn.ReLU()
    tied = student.config.tie_word_embeddings
    if tied and student.lm_head.weight is not student.model.embed_tokens.weight:
        raise RuntimeError("tie_word_embeddings is set but lm_head is not tied")
    max_pos = student.config.max_position_embeddings
    if seq_len > max_pos:
        raise click.UsageError(f"--seq-len {seq_len} exceeds max_position_embeddings {max_pos}")

    # ---- data
    text = Path(data_path).read_text(encoding="utf-8")
    chunks = split_chunks(text)
    train_chunks, held_chunks = split_train_heldout(chunks, heldout_frac)
    bos = tokenizer.bos_token_id
    train_stream = token_stream(tokenizer, train_chunks, bos)
    held_seqs = pack(token_stream(tokenizer, held_chunks, bos), seq_len)
    if held_seqs.shape[0] == 0:
        raise click.UsageError("held-out text is shorter than one sequence")
    if train_stream.numel() <= seq_len:
        raise click.UsageError("training text is shorter than one sequence")
    click.echo(f"chunks: {len(train_chunks)} train / {len(held_chunks)} held-out; "
               f"train tokens {train_stream.numel()}, held-out sequences {held_seqs.shape[0]} x {seq_len}")

    if calibration_out:
        cal, size = [], 0
        for c in train_chunks:
            if size >= calibration_bytes:
                break
            cal.append(c)
            size += len(c.encode("utf-8")) + 2
        cal_path = Path(calibration_out)
        cal_path.parent.mkdir(parents=True, exist_ok=True)
        tmp_cal = cal_path.with_name(f".{cal_path.name}.tmp-{os.getpid()}")
        tmp_cal.write_text("\n\n".join(cal) + "\n", encoding="utf-8")
        os.replace(tmp_cal, cal_path)
        click.echo(f"calibration text: {cal_path} ({cal_path.stat().st_size} bytes, "
                   f"first {len(cal)} training chunks)")

    # ---- base evaluation
    base_eval = evaluate(teacher, held_seqs, eval_batch_size)
    click.echo(f"base (SiLU) held-out loss {base_eval['loss']:.4f}, "
               f"share gate<=0 {base_eval['sparsity_mean']:.3f}")

    # ---- training
    decay, no_decay = [], []
    for n, p in student.named_parameters():
        (decay if p.ndim >= 2 else no_decay).append(p)
    opt = torch.optim.AdamW(
        [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
        lr=lr, betas=(0.9, 0.95), eps=1e-8,
    )
    gen = torch.Generator().manual_seed(seed)
    rec = GateRecorder(student)
    n_layers = len(student.model.layers)
    student.train()
    ema = None
    t_train = time.time()
    pbar = tqdm(range(steps), desc="relufy", dynamic_ncols=True)
    for step in pbar:
        cur_lr = lr_at(step, steps, lr, warmup, min_lr_frac)
        for g in opt.param_groups:
            g["lr"] = cur_lr
        lam = l1_at(step, steps, l1_max, l1_ramp)

        starts = torch.randint(0, train_stream.numel() - seq_len + 1, (batch_size,), generator=gen)
        x = torch.stack([train_stream[s : s + seq_len] for s in starts.tolist()])
        with torch.no_grad():
            t_logits = teacher(input_ids=x, use_cache=False).logits
        rec.clear()
        s_logits = student(input_ids=x, use_cache=False).logits
        vocab = s_logits.shape[-1]

        ce = F.cross_entropy(s_logits[:, :-1].reshape(-1, vocab), x[:, 1:].reshape(-1))
        kl = F.kl_div(
            F.log_softmax(s_logits.reshape(-1, vocab) / kl_temp, -1),
            F.log_softmax(t_logits.reshape(-1, vocab) / kl_temp, -1),
            log_target=True, reduction="batchmean",
        ) * (kl_temp ** 2)
        l1 = sum(F.relu(g).mean() for g in rec.outputs) / n_layers
        loss = ce_weight * ce + kl_weight * kl + lam * l1

        opt.zero_grad(set_to_none=True)
        loss.backward()
        if grad_clip > 0:
            torch.nn.utils.clip_grad_norm_(student.parameters(), grad_clip)
        opt.step()

        with torch.no_grad():
            sp = sum((g <= 0).float().mean().item() for g in rec.outputs) / n_layers
        cur = (ce.item(), kl.item(), sp)
        ema = cur if ema is None else tuple(0.98 * a + 0.02 * b for a, b in zip(ema, cur))
        if step % 10 == 0 or step == steps - 1:
            pbar.set_postfix(ce=f"{ema[0]:.3f}", kl=f"{ema[1]:.3f}", sparsity=f"{ema[2]:.3f}",
                             l1=f"{lam:.3g}", lr=f"{cur_lr:.2e}")
    rec.remove()
    student.eval()
    train_time = time.time() - t_train

    # ---- write atomically, then evaluate what was written
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.tmp-", dir=out.parent))
    try:
        student.save_pretrained(tmp)
        _write_config_compat(tmp / "config.json", base_config)
        if not (tmp / "generation_config.json").exists() and (base / "generation_config.json").exists():
            shutil.copy2(base / "generation_config.json", tmp / "generation_config.json")
        for name in TOKENIZER_FILES:
            if (base / name).exists():
                shutil.copyfile(base / name, tmp / name)

        relu = LlamaForCausalLM.from_pretrained(tmp, dtype=torch.float32).eval()
        assert relu.config.hidden_act == "relu"
        if tied:
            assert relu.lm_head.weight is relu.model.embed_tokens.weight
        relu_eval = evaluate(relu, held_seqs, eval_batch_size)
        sample = greedy_sample(relu, tokenizer, sample_prompt, sample_tokens)
        base_sample = greedy_sample(teacher, tokenizer, sample_prompt, sample_tokens)

        rel = relu_eval["loss"] / base_eval["loss"] - 1.0
        report = {
            "recipe": "recipes/relufy.py",
            "base": str(base),
            "data": str(data_path),
            "data_protocol": {
                "split": "blank-line separated chunks; last heldout_frac of chunks held out (eval only)",
                "n_train_chunks": len(train_chunks),
                "n_heldout_chunks": len(held_chunks),
                "n_train_tokens": int(train_stream.numel()),
                "n_heldout_sequences": int(held_seqs.shape[0]),
                "seq_len": seq_len,
                "tokenizer": "AutoTokenizer(base), BOS-prefixed per chunk, no EOS",
            },
            "base_heldout_loss": base_eval["loss"],
            "relu_heldout_loss": relu_eval["loss"],
            "relative_loss_increase": rel,
            "sparsity_per_layer": relu_eval["sparsity_per_layer"],
            "sparsity_mean": relu_eval["sparsity_mean"],
            "sparsity_definition": "share of (token, layer, neuron) with gate_proj(x) <= 0 on held-out tokens",
            "base_gate_nonpositive_per_layer": base_eval["sparsity_per_layer"],
            "base_gate_nonpositive_mean": base_eval["sparsity_mean"],
            "n_heldout_tokens": relu_eval["n_tokens"],
            "n_heldout_loss_targets": relu_eval["n_loss_targets"],
            "steps": steps,
            "hyperparameters": {
                "batch_size": batch_size, "seq_len": seq_len, "lr": lr, "min_lr_frac": min_lr_frac,
                "warmup": warmup, "lr_schedule": "linear warm-up, cosine decay",
                "optimizer": "AdamW(betas=(0.9, 0.95))", "weight_decay": weight_decay,
                "grad_clip": grad_clip, "l1_max": l1_max, "l1_ramp": l1_ramp,
                "l1_schedule": "sine quarter-wave 0 -> l1_max over l1_ramp*steps, then held",
                "l1_target": "mean over tokens, neurons, layers of relu(gate_proj(x))",
                "kl_weight": kl_weight, "kl_temp": kl_temp, "ce_weight": ce_weight,
                "heldout_frac": heldout_frac, "seed": seed, "threads": threads,
            },
            "train_wall_time_s": round(train_time, 1),
            "total_wall_time_s": round(time.time() - t_start, 1),
            "sample_prompt": sample_prompt,
            "greedy_sample_relu": sample,
            "greedy_sample_base": base_sample,
            "versions": {"torch": torch.__version__, "transformers": __import__("transformers").__version__},
        }
        (tmp / "relufy_report.json").write_text(json.dumps(report, indent=2) + "\n")
        for f in tmp.iterdir():
            f.chmod(0o644)
        tmp.chmod(0o755)
        _install_dir(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise

    click.echo(json.dumps({k: report[k] for k in (
        "base_heldout_loss", "relu_heldout_loss", "relative_loss_increase",
        "sparsity_per_layer", "sparsity_mean", "n_heldout_tokens", "steps")}, indent=2))
    click.echo(f"greedy sample: {sample!r}")
    click.echo(f"wrote {out} in {time.time() - t_start:.0f} s")


if __name__ == "__main__":
    main()
