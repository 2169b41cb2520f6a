"""Small randomly initialised models of every family, saved in their published HF layout.

Each is the real config shrunk with its structure kept: GQA ratio, parallel attention
and two layernorms (Falcon-40B), biases and learned positions (OPT), a sliding window
shorter than the test prompt (Bamboo), FATReLU with a threshold that matters
(ProSparse). Configs carry the ``auto_map`` of the published repos, which the loader
must ignore (no remote code). Llama-body models use stories260K's SentencePiece
tokenizer (vocab 512); Falcon and OPT get a byte-level BPE trained here on
TinyStories text (Falcon with Falcon's own pre-tokenizer).
"""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch

from helpers import STORIES, TEXT, make_tiny_llama, need

N_LAYER = 3
PROSPARSE_THRESHOLD = 0.3  # ProSparse-7B ships 0.01; larger here so FATReLU differs from ReLU at this scale


def _randomize(model: torch.nn.Module, seed: int, std: float = 0.2) -> None:
    """Weights (2-D, and 3-D stacked experts) N(0, ``std``); 1-D parameters (norm weights, biases) around 1
    and 0 with spread 0.1."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() >= 2:
                p.copy_(torch.randn(p.shape, generator=g) * std)
            elif name.endswith("bias"):
                p.copy_(torch.randn(p.shape, generator=g) * 0.1)
            else:
                p.copy_(1.0 + torch.randn(p.shape, generator=g) * 0.1)


def _spm_tokenizer(out_dir: Path) -> None:
    for name in ("tokenizer.model", "tokenizer_config.json"):
        shutil.copy(STORIES / "hf" / name, out_dir / name)
        (out_dir / name).chmod(0o644)


def _save(model: torch.nn.Module, out_dir: Path, edit: dict | None = None, drop: tuple[str, ...] = ()) -> Path:
    model.save_pretrained(out_dir)
    cfg = json.loads((out_dir / "config.json").read_text())
    for k in drop:
        cfg.pop(k, None)
    cfg.update(edit or {})
    (out_dir / "config.json").write_text(json.dumps(cfg, indent=1))
    return out_dir


def train_bpe(out_dir: Path, falcon_pre: bool, vocab_size: int = 384) -> int:
    """A byte-level BPE ``tokenizer.json`` (+ config, eos ``<|endoftext|>`` id 0); returns its size."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers as pt, trainers

    tk = Tokenizer(models.BPE())
    byte_level = pt.ByteLevel(add_prefix_space=False, use_regex=True)
    tk.pre_tokenizer = pt.Sequence([pt.Punctuation("contiguous"), byte_level, pt.Digits(individual_digits=False),
                                    pt.Split(Regex("[0-9][0-9][0-9]"), "isolated")]) if falcon_pre else byte_level
    tk.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=["<|endoftext|>"],
                                  initial_alphabet=pt.ByteLevel.alphabet(), show_progress=False)
    text = need(TEXT / "tinystories_sample.txt").read_text()
    tk.train_from_iterator([text[i:i + 2000] for i in range(0, len(text), 2000)], trainer)
    out_dir.mkdir(parents=True, exist_ok=True)
    tk.save(str(out_dir / "tokenizer.json"))
    (out_dir / "tokenizer_config.json").write_text(json.dumps(
        {"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": "<|endoftext|>", "bos_token": "<|endoftext|>",
         "add_prefix_space": False}))
    return tk.get_vocab_size()


def make_relu_llama(out_dir: Path) -> Path:
    """ReluLLaMA-70B's shape ratio (GQA 8 q heads per kv head -> here 4:2), hidden_act relu."""
    return make_tiny_llama(out_dir, n_layer=N_LAYER, n_embd=32, n_ff=48, n_head=4, n_head_kv=2)


def make_prosparse(out_dir: Path) -> Path:
    """ProSparse-Llama-2: SparseLlamaForCausalLM, hidden_act fatrelu, threshold in hidden_act_param."""
    from powerinfer.models import SparseLlamaConfig, SparseLlamaForCausalLM

    cfg = SparseLlamaConfig(vocab_size=512, hidden_size=32, intermediate_size=48, num_hidden_layers=N_LAYER,
                            num_attention_heads=4, num_key_value_heads=4, hidden_act="fatrelu",
                            hidden_act_param=PROSPARSE_THRESHOLD, max_position_embeddings=4096,
                            rms_norm_eps=1e-5, bos_token_id=1, eos_token_id=2, tie_word_embeddings=False)
    torch.manual_seed(1)
    model = SparseLlamaForCausalLM(cfg)
    _randomize(model, 1)
    _save(model, out_dir, {"auto_map": {"AutoConfig": "configuration_sparsellama.SparseLlamaConfig",
                                        "AutoModelForCausalLM": "modeling_sparsellama.SparseLlamaForCausalLM"}})
    _spm_tokenizer(out_dir)
    return out_dir


SLIDING_WINDOW = 8


def make_bamboo(out_dir: Path) -> Path:
    """Bamboo-7B: Mistral body, GQA 4 q heads per kv head, dReLU, sliding_window 8 (< the test prompt)."""
    from powerinfer.models import BambooConfig, BambooForCausalLM

    cfg = BambooConfig(vocab_size=512, hidden_size=64, intermediate_size=96, num_hidden_layers=N_LAYER,
                       num_attention_heads=8, num_key_value_heads=2, hidden_act="relu",
                       max_position_embeddings=32768, sliding_window=SLIDING_WINDOW, rms_norm_eps=1e-5,
                       bos_token_id=1, eos_token_id=2, tie_word_embeddings=False)
    torch.manual_seed(2)
    model = BambooForCausalLM(cfg)
    _randomize(model, 2)
    _save(model, out_dir, {"auto_map": {"AutoConfig": "configuration_bamboo.BambooConfig",
                                        "AutoModelForCausalLM": "modeling_bamboo.BambooForCausalLM"}})
    _spm_tokenizer(out_dir)
    return out_dir


def make_falcon(out_dir: Path, legacy: bool = False, activation: str | None = "relu", seven_b: bool = False) -> Path:
    """ReLU-Falcon-40B's layout: new_decoder_architecture, parallel attention, ln_attn + ln_mlp, no biases,
    GQA 4 q heads per kv head, tied output, bos = eos.

    ``legacy=True`` writes the same weights with a ``RWForCausalLM`` / ``RefinedWeb`` config (``n_layer``,
    ``n_head``, ``n_head_kv``); ``activation=None`` leaves the activation key out; ``seven_b=True`` is
    Falcon-7B's older layout instead (one input layernorm shared by both branches, multi-query attention).
    """
    from transformers import FalconConfig, FalconForCausalLM

    n_vocab = train_bpe(out_dir, falcon_pre=True)
    cfg = FalconConfig(vocab_size=n_vocab, hidden_size=64, num_hidden_layers=N_LAYER, num_attention_heads=8,
                       num_kv_heads=None if seven_b else 2, new_decoder_architecture=not seven_b,
                       multi_query=seven_b, parallel_attn=True, bias=False,
                       alibi=False, activation=activation or "gelu", layer_norm_epsilon=1e-5,
                       max_position_embeddings=2048, bos_token_id=0, eos_token_id=0)
    torch.manual_seed(3)
    model = FalconForCausalLM(cfg)
    _randomize(model, 3)
    if not legacy:
        return _save(model, out_dir, None, drop=() if activation else ("activation",))
    keep = {"vocab_size", "hidden_size", "layer_norm_epsilon", "initializer_range", "bos_token_id",
            "eos_token_id", "hidden_dropout", "attention_dropout", "bias", "parallel_attn", "alibi"}
    _save(model, out_dir)
    full = json.loads((out_dir / "config.json").read_text())
    legacy_cfg = {k: v for k, v in full.items() if k in keep}
    legacy_cfg.update({"architectures": ["RWForCausalLM"], "model_type": "RefinedWeb", "n_layer": N_LAYER,
                       "n_head": 8, "n_head_kv": 2, "apply_residual_connection_post_layernorm": False,
                       "auto_map": {"AutoConfig": "configuration_RW.RWConfig",
                                    "AutoModelForCausalLM": "modelling_RW.RWForCausalLM"}})
    if activation:
        legacy_cfg["activation"] = activation
    (out_dir / "config.json").write_text(json.dumps(legacy_cfg, indent=1))
    return out_dir


def make_opt(out_dir: Path, decoder_prefix: bool = False) -> Path:
    """OPT: pre-LN, biases everywhere, learned positions (2048 + 2 rows, as upstream wants), tied output.

    The model's vocab is 3 rows larger than the tokenizer (as OPT's 50272 vs 50265), so the
    converter pads. ``decoder_prefix=True`` renames tensors to the published ``decoder.*`` names.
    """
    from safetensors.torch import load_file, save_file
    from transformers import OPTConfig, OPTForCausalLM

    n_vocab = train_bpe(out_dir, falcon_pre=False)
    cfg = OPTConfig(vocab_size=n_vocab + 3, hidden_size=64, ffn_dim=256, num_hidden_layers=N_LAYER,
                    num_attention_heads=4, max_position_embeddings=2048, do_layer_norm_before=True,
                    word_embed_proj_dim=64, activation_function="relu", enable_bias=True,
                    bos_token_id=0, eos_token_id=0, pad_token_id=1)
    torch.manual_seed(4)
    model = OPTForCausalLM(cfg)
    _randomize(model, 4)
    _save(model, out_dir)
    if decoder_prefix:
        sd = load_file(out_dir / "model.safetensors")
        save_file({k.removeprefix("model."): v.contiguous() for k, v in sd.items()}, out_dir / "model.safetensors",
                  metadata={"format": "pt"})
    return out_dir


# --------------------------------------------------------------------------- modern dense families
LLAMA3_ROPE = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 256}  # head_dim 16, theta 5e5: pairs 0-1 kept, 2 smoothed, 3-7 /8
MISTRAL_WINDOW = 8  # shorter than the test prompt


def _modern(cls_name: str, out_dir: Path, seed: int, weight_std: float = 0.2, **cfg_kw) -> Path:
    """A tiny random ``{cls_name}`` (vocab 512 with stories260K's SentencePiece tokenizer, n_embd 64,
    n_ff 128, N_LAYER layers, 4 heads / 2 kv heads unless ``cfg_kw`` says otherwise) saved in HF layout;
    matrices N(0, ``weight_std``)."""
    import transformers

    kw = dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=N_LAYER,
              num_attention_heads=4, num_key_value_heads=2, hidden_act="silu", max_position_embeddings=2048,
              rms_norm_eps=1e-5, bos_token_id=1, eos_token_id=2, tie_word_embeddings=False)
    kw.update(cfg_kw)
    cfg = getattr(transformers, cls_name.replace("ForCausalLM", "Config"))(**kw)
    torch.manual_seed(seed)
    model = getattr(transformers, cls_name)(cfg)
    _randomize(model, seed, weight_std)
    if cfg.tie_word_embeddings:
        model.tie_weights()
    _save(model, out_dir)
    _spm_tokenizer(out_dir)
    return out_dir


def make_llama3(out_dir: Path, tied: bool = False, **kw) -> Path:
    """Llama 3.1: GQA 2 q heads per kv head, rope_theta 5e5, llama3 rope scaling; ``tied``: the 3.2 1B/3B
    layout (output tied to the embedding, no lm_head in the checkpoint). ``kw``: config overrides."""
    return _modern("LlamaForCausalLM", out_dir, 11 + tied, **{"rope_theta": 500000.0,
                   "rope_scaling": dict(LLAMA3_ROPE), "tie_word_embeddings": tied, **kw})


def make_qwen2(out_dir: Path, **kw) -> Path:
    """Qwen2.5-0.5B's layout: Q/K/V biases, tied output, rope_theta 1e6, eps 1e-6. ``kw``: config overrides."""
    return _modern("Qwen2ForCausalLM", out_dir, 13, **{"rope_theta": 1000000.0, "rms_norm_eps": 1e-6,
                   "tie_word_embeddings": True, "use_sliding_window": False, **kw})


def make_qwen3(out_dir: Path, **kw) -> Path:
    """Qwen3: per-head q_norm/k_norm, explicit head_dim 32 (4 heads of 32 > n_embd 64), no biases.
    ``kw``: config overrides."""
    return _modern("Qwen3ForCausalLM", out_dir, 14, **{"rope_theta": 1000000.0, "rms_norm_eps": 1e-6,
                   "head_dim": 32, "use_sliding_window": False, **kw})


def make_mistral(out_dir: Path) -> Path:
    """Mistral 7B v0.1: GQA, sliding_window shorter than the test prompt."""
    return _modern("MistralForCausalLM", out_dir, 15, sliding_window=MISTRAL_WINDOW, rope_theta=10000.0)


def make_nemo(out_dir: Path) -> Path:
    """Mistral-Nemo: head_dim 24 with 4 heads (96 != n_embd 64), no sliding window, rope_theta 1e6."""
    return _modern("MistralForCausalLM", out_dir, 16, head_dim=24, sliding_window=None, rope_theta=1000000.0)


def make_mixtral(out_dir: Path, **kw) -> Path:
    """Mixtral 8x7B's layout shrunk: 4 experts of width 64, 2 per token, GQA 4/2, rope_theta 1e6, no window."""
    return _modern("MixtralForCausalLM", out_dir, 17, **{"num_local_experts": 4, "num_experts_per_tok": 2,
                   "intermediate_size": 64, "rope_theta": 1000000.0, "sliding_window": None, **kw})


def make_mixtral_kquant(out_dir: Path) -> Path:
    """A Mixtral wide enough for llama.cpp's K-quants (n_embd 256, 4 experts of width 256, 2 per token,
    2 layers; weights N(0, 0.05), so the 256-wide products do not blow the activations up)."""
    return make_mixtral(out_dir, hidden_size=256, intermediate_size=256, num_hidden_layers=2, weight_std=0.05)


def make_qwen3moe(out_dir: Path, **kw) -> Path:
    """Qwen3-30B-A3B's layout shrunk: 8 experts of width 32 (``moe_intermediate_size``), 3 per token,
    ``norm_topk_prob`` true (as published), q/k norms, head_dim 32, dense width 128 unused."""
    return _modern("Qwen3MoeForCausalLM", out_dir, 18, **{"num_experts": 8, "num_experts_per_tok": 3,
                   "moe_intermediate_size": 32, "norm_topk_prob": True, "rope_theta": 1000000.0,
                   "rms_norm_eps": 1e-6, "head_dim": 32, "use_sliding_window": False, **kw})


SMALLTHINKER_CONFIG = {
    "architectures": ["SmallThinkerForCausalLM"], "model_type": "smallthinker", "vocab_size": 512,
    "hidden_size": 64, "num_hidden_layers": N_LAYER, "num_attention_heads": 4, "num_key_value_heads": 2,
    "head_dim": 16, "moe_num_primary_experts": 4, "moe_num_active_primary_experts": 2, "moe_ffn_hidden_size": 64,
    "moe_primary_router_apply_softmax": False, "sliding_window_layout": [0, 1, 1], "sliding_window_size": 4096,
    "rms_norm_eps": 1e-6, "rope_theta": 1000000.0, "max_position_embeddings": 4096, "hidden_act": "relu",
    "tie_word_embeddings": False, "bos_token_id": 1, "eos_token_id": 2, "torch_dtype": "float32",
}


def make_smallthinker(out_dir: Path, **kw) -> Path:
    """SmallThinker-4BA0.6B's layout shrunk (transformers has no class: the checkpoint is written here by
    name): 4 ReLU experts of width 64, 2 per token, a sigmoid router on the layer input, layer 0 full
    attention without RoPE and layers 1-2 sliding (window 4096, as published), GQA 4/2."""
    from safetensors.torch import save_file

    cfg = {**SMALLTHINKER_CONFIG, **kw}
    D, hd, V, E, Fx = cfg["hidden_size"], cfg["head_dim"], cfg["vocab_size"], cfg["moe_num_primary_experts"], \
        cfg["moe_ffn_hidden_size"]
    shapes = {"model.embed_tokens.weight": (V, D), "model.norm.weight": (D,), "lm_head.weight": (V, D)}
    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}."
        shapes.update({p + "input_layernorm.weight": (D,), p + "post_attention_layernorm.weight": (D,),
                       p + "self_attn.q_proj.weight": (4 * hd, D), p + "self_attn.k_proj.weight": (2 * hd, D),
                       p + "self_attn.v_proj.weight": (2 * hd, D), p + "self_attn.o_proj.weight": (D, 4 * hd),
                       p + "block_sparse_moe.primary_router.weight": (E, D)})
        for x in range(E):
            q = f"{p}block_sparse_moe.experts.{x}."
            shapes.update({q + "gate.weight": (Fx, D), q + "up.weight": (Fx, D), q + "down.weight": (D, Fx)})
    g = torch.Generator().manual_seed(19)
    sd = {k: (torch.randn(s, generator=g) * 0.2 if len(s) == 2 else 1.0 + torch.randn(s, generator=g) * 0.1)
          for k, s in shapes.items()}
    out_dir.mkdir(parents=True, exist_ok=True)
    save_file(sd, out_dir / "model.safetensors", metadata={"format": "pt"})
    (out_dir / "config.json").write_text(json.dumps(cfg, indent=1))
    _spm_tokenizer(out_dir)
    return out_dir


MOE_BUILDERS = {
    "mixtral": make_mixtral,
    "qwen3moe": make_qwen3moe,
}


MODERN_BUILDERS = {
    "llama3": make_llama3,
    "llama3_tied": lambda d: make_llama3(d, tied=True),
    "qwen2": make_qwen2,
    "qwen3": make_qwen3,
    "mistral": make_mistral,
    "nemo": make_nemo,
}


BUILDERS = {
    "relu_llama": make_relu_llama,
    "prosparse": make_prosparse,
    "bamboo": make_bamboo,
    "falcon": make_falcon,
    "falcon_legacy": lambda d: make_falcon(d, legacy=True),
    "opt": make_opt,
}
