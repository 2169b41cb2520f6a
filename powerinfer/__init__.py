"""PowerInfer in Python: profile, predict, place and run ReLU-sparse LLMs.

Stages (one console command each): ``pi-profile`` (powerinfer.profile),
``pi-train-predictor`` (powerinfer.train_predictor), ``pi-convert``
(powerinfer.convert) and ``pi-run`` (powerinfer.runtime). ``python -m powerinfer``
is the upstream-compatible neuron placement solver.
"""
from pathlib import Path

__version__ = "0.1.0"

ASSETS = Path(__file__).parent / "assets"
DEMO_MODEL = ASSETS / "stories260K-relu"
DEMO_CALIBRATION = ASSETS / "calibration.txt"
