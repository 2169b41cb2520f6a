"""Limits shared by every stage and file contract, in one place so that what one stage writes
the next accepts (imports nothing heavy: CLIs read them when parsing options).

Thresholds: a predictor's logit cut-off (``sparse_threshold``) or FATReLU's activation
threshold beyond :data:`MAX_THRESHOLD` is sigmoid 0 or 1 in any precision, so nothing larger
is meaningful; the GGUF loader, pi-train-predictor and pi-convert all bound them by it.
"""
MAX_LAYERS = 4096  # n_layer of a model, an activation or a predictor folder
MAX_THRESHOLD = 1e3  # |sparse_threshold|, and FATReLU's threshold in [0, MAX_THRESHOLD]
MAX_ROPE_BASE = 1e12  # rope freq_base / rope_theta
MAX_BUDGET_GIB = 1 << 20  # --vram-budget: 1 PiB, more than any GPU; bounds int(budget * GiB)
