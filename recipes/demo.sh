#!/usr/bin/env bash
# The whole pipeline on the bundled demo model (stories260K made ReLU-sparse):
# install, profile, train predictors, convert to a PowerInfer GGUF, and generate; then sparse
# against dense on a 7B-width model, where the FFN is most of the work.
# Usage: bash recipes/demo.sh [OUT_DIR]   (default ./out/demo; re-runnable)
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${1:-out/demo}
MODEL=powerinfer/assets/stories260K-relu
DATA=powerinfer/assets/calibration.txt

echo "== installing into $(command -v python) (CPU torch wheel, then this package; quick when already there)"
python -m pip install --quiet "torch==2.13.0"
python -m pip install --quiet -e ".[test]"
BIN=$(python -c 'import os, sys; print(os.path.dirname(sys.executable))')
export PATH="$BIN:$PATH"  # the pi-* scripts of this interpreter, not another install's
mkdir -p "$OUT"

echo "== 1/5 pi-profile: which FFN neurons fire on the calibration text"
pi-profile "$MODEL" --data "$DATA" --out "$OUT/activation"

echo "== 2/5 pi-train-predictor: per-layer fc2(relu(fc1 x)) predictors"
# the bundled text holds ~50K training and ~6.3K held-out tokens: ask for what is there
pi-train-predictor "$MODEL" --data "$DATA" --out "$OUT/predictor" --work-dir "$OUT/predictor-work" \
    --max-tokens 51200 --heldout-tokens 6400

echo "== 3/5 pi-convert: PowerInfer GGUF (weights + predictors) and a dense GGUF"
# --for-pi-run: these files are for pi-run (upstream PowerInfer mis-runs n_ff <= 1000, and runs dense
# llama files with SiLU), so no warnings about upstream
pi-convert "$MODEL" "$OUT/predictor" --outfile "$OUT/stories260K-relu.powerinfer.gguf" --for-pi-run
pi-convert "$MODEL" --outfile "$OUT/stories260K-relu.gguf" --for-pi-run

echo "== 4/5 pi-run: sparse generation (then the same prompt dense, for comparison)"
pi-run -m "$OUT/stories260K-relu.powerinfer.gguf" -p "Once upon a time" -n 200 --temp 0 -t 1
pi-run -m "$OUT/stories260K-relu.gguf" -p "Once upon a time" -n 200 --temp 0 -t 1

echo "== 5/5 sparse vs dense where the FFN is most of the work: a 7B-width model (2 layers, designed predictors, Q4_0)"
python -m powerinfer.speed_demo "$OUT/speed"
