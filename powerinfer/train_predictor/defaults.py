"""Defaults the ``pi-train-predictor`` command line shows, kept apart from the training modules
(which import torch) so that ``--help`` stays fast."""
from __future__ import annotations

DEFAULT_TARGET_RECALL = 0.99  # README "Predictor width from a target recall": benchmarks/bench_target_recall.py
