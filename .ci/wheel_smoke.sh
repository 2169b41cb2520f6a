#!/usr/bin/env bash
# CI: a normal install. Build a wheel from this checkout, install it into a fresh virtual
# environment (no system site packages, no editable link to the source), then run every console
# command on the bundled demo model from a folder outside the source tree:
#   pi-profile, pi-train-predictor, pi-convert (PWRI and dense), pi-quantize, pi-run (sparse,
#   dense, --ram-budget on a model that fits, --ram-budget reading cold rows from disk on a wider
#   model), pi-perplexity (also under --ram-budget), pi-report, pi-server (start, one request, stop).
# Usage: bash .ci/wheel_smoke.sh [WORK_DIR]   (default: a new temporary folder, removed at the end)
# $PYTHON: the interpreter that builds the wheel and the venv (default python).
set -euo pipefail
SRC=$(cd "$(dirname "$0")/.." && pwd)
PY=${PYTHON:-python}
if [ $# -ge 1 ]; then
    WORK=$1
    mkdir -p "$WORK"
else
    WORK=$(mktemp -d)
    trap 'rm -rf "$WORK"' EXIT
fi
WORK=$(cd "$WORK" && pwd)
t0=$SECONDS
step() { echo "== [$((SECONDS - t0)) s] $*"; }

step "wheel from $SRC"
rm -rf "$WORK/dist" "$WORK/src"
# built from a copy: the checkout gets no build/ or egg-info, and only what the wheel holds is used
mkdir -p "$WORK/src"
cp "$SRC/pyproject.toml" "$SRC/README.md" "$WORK/src/"
cp -r "$SRC/powerinfer" "$WORK/src/"
find "$WORK/src" -name __pycache__ -prune -exec rm -rf {} +
# setuptools that can build wheels here: build with it (offline); else pip fetches one (isolated build)
if "$PY" -c "import setuptools.command.bdist_wheel" 2>/dev/null; then ISO=--no-build-isolation; else ISO=; fi
"$PY" -m pip wheel --quiet --no-deps $ISO -w "$WORK/dist" "$WORK/src"
WHEEL=$(ls "$WORK"/dist/powerinfer-*.whl)
rm -rf "$WORK/src"
echo "   $(basename "$WHEEL"): $("$PY" -c "import sys, zipfile; print(len(zipfile.ZipFile(sys.argv[1]).namelist()))" "$WHEEL") files"

step "fresh venv $WORK/venv: torch==2.13.0, then the wheel (with its report extra) and its dependencies"
rm -rf "$WORK/venv"
"$PY" -m venv "$WORK/venv"
V="$WORK/venv/bin"
"$V/python" -m pip install --quiet "torch==2.13.0"
"$V/python" -m pip install --quiet "$WHEEL[report]"  # the report extra: pi-report's figure (matplotlib)
export PATH="$V:$PATH"
export POWERINFER_CACHE="$WORK/cache"  # the kernels and row caches of this run only
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
unset PYTHONPATH

cd "$WORK"  # outside the source tree: nothing may come from the checkout
PKG=$("$V/python" -c "import powerinfer, os; print(os.path.dirname(powerinfer.__file__))")
case "$PKG" in "$SRC"*) echo "FAIL: powerinfer imported from the checkout ($PKG)"; exit 1;; esac
[ -f "$PKG/runtime/cold_rows.c" ] || { echo "FAIL: $PKG/runtime/cold_rows.c not installed"; exit 1; }
echo "   powerinfer from $PKG"
MODEL="$PKG/assets/stories260K-relu"
DATA="$PKG/assets/calibration.txt"
OUT="$WORK/out"
rm -rf "$OUT" && mkdir -p "$OUT"

step "pi-profile"
pi-profile "$MODEL" --data "$DATA" --out "$OUT/activation" --max-tokens 8192 2>&1 | tail -n 2
step "pi-train-predictor"
pi-train-predictor "$MODEL" --data "$DATA" --out "$OUT/predictor" --work-dir "$OUT/predictor-work" \
    --max-tokens 8192 --heldout-tokens 2048 --epochs 3 2>&1 | tail -n 1
step "pi-convert (PWRI and dense)"
pi-convert "$MODEL" "$OUT/predictor" --outfile "$OUT/demo.powerinfer.gguf" --for-pi-run 2>&1 | tail -n 1
pi-convert "$MODEL" --outfile "$OUT/demo.gguf" --for-pi-run 2>&1 | tail -n 1
step "pi-quantize q8_0"
pi-quantize --no-progress "$OUT/demo.powerinfer.gguf" "$OUT/demo.q8_0.powerinfer.gguf" q8_0 2>&1 | tail -n 1

expect() {  # expect PATTERN FILE: the line of FILE matching PATTERN, or fail showing FILE
    grep -E -m1 -- "$1" "$2" || { echo "FAIL: no '$1' in:"; cat "$2"; exit 1; }
}
step "pi-run sparse, dense, quantized"
for m in demo.powerinfer.gguf demo.gguf demo.q8_0.powerinfer.gguf; do
    pi-run -m "$OUT/$m" -p "Once upon a time" -n 24 --temp 0 -t 1 >"$OUT/run.txt" 2>&1
    echo "   $m: $(expect '^Once upon a time' "$OUT/run.txt" | cut -c1-70)"
done
step "pi-run --ram-budget on a model that fits (the ordinary resident path)"
pi-run -m "$OUT/demo.powerinfer.gguf" -p "Once upon a time" -n 24 --temp 0 -t 1 --ram-budget 4 >"$OUT/run.txt" 2>&1
expect 'the whole model fits' "$OUT/run.txt"
[ ! -e "$POWERINFER_CACHE/rows" ] || { echo "FAIL: a model that fits wrote a row cache"; exit 1; }
step "pi-run --ram-budget reading cold rows from disk (a wider model: n_embd 1024, n_ff 8192, 4 layers, Q8_0)"
"$V/python" - "$OUT/wide" <<'EOF'
import sys
from powerinfer import DEMO_CALIBRATION, DEMO_MODEL
from powerinfer.synthetic import Shape, build_designed_model
from transformers.utils import logging
logging.disable_progress_bar()
shape = Shape(n_layer=4, n_embd=1024, n_ff=8192, n_head=8, n_vocab=512, n_ctx=256, hidden=128)
build_designed_model(sys.argv[1], shape, DEMO_MODEL, DEMO_CALIBRATION.read_text(encoding="utf-8"),
                     sparse_name="wide.powerinfer.gguf", dense_name="wide.gguf", outtype="q8_0",
                     upstream_warnings=False, log=lambda s: None)
EOF
WIDE="$OUT/wide/wide.powerinfer.gguf"
pi-run -m "$WIDE" -n 4 -c 64 --ram-budget 0.001 >"$OUT/run.txt" 2>&1 && { echo "FAIL: a budget below the minimum ran"; exit 1; }
MIN=$(expect 'give at least' "$OUT/run.txt" | sed -E 's/.*give at least ([0-9.]+) GiB.*/\1/')
BUDGET=$("$V/python" -c "print(f'{$MIN + 0.05:.3f}')")  # ~54 MB above the minimum: ~half the FFN rows (107 MB)
pi-run -m "$WIDE" -p "Once upon a time" -n 16 -c 64 --temp 0 -t 1 --ram-budget "$BUDGET" --bench >"$OUT/run.txt" 2>&1
echo "   minimum $MIN GiB, budget $BUDGET GiB"
expect 'the other FFN rows are read from disk' "$OUT/run.txt" | cut -c1-160
expect 'cold rows: rows read from the row cache' "$OUT/run.txt" | cut -c1-160
"$V/python" - "$OUT/run.txt" <<'EOF'
import re, sys
t = open(sys.argv[1]).read()
reads = float(re.search(r"per token (\d+) reads", t).group(1))
assert reads > 0, "no cold row was read"
print(f"   {reads:.0f} reads per token")
EOF
# the text (the random model's tokens) against the unlimited run's, both in f32
pi-run -m "$WIDE" -p "Once upon a time" -n 16 -c 64 --temp 0 -t 1 --dtype f32 --ram-budget "$BUDGET" >"$OUT/run.txt" 2>&1
pi-run -m "$WIDE" -p "Once upon a time" -n 16 -c 64 --temp 0 -t 1 --dtype f32 >"$OUT/ref.txt" 2>&1
"$V/python" - "$OUT/ref.txt" "$OUT/run.txt" <<'EOF'
import sys
def text(p):
    return [ln for ln in open(p, errors="replace") if ln.startswith("Once upon a time")][0]
assert text(sys.argv[1]) == text(sys.argv[2]), "the budget run's text differs from the unlimited run's"
print("   same text as the unlimited run")
EOF

step "pi-perplexity (and under --ram-budget)"
head -c 6000 "$DATA" >"$OUT/ppl.txt"
pi-perplexity -m "$OUT/demo.powerinfer.gguf" -f "$OUT/ppl.txt" -c 64 --chunks 3 >"$OUT/ppl.out" 2>&1
expect 'Final estimate: PPL' "$OUT/ppl.out"
pi-perplexity -m "$OUT/demo.powerinfer.gguf" -f "$OUT/ppl.txt" -c 64 --chunks 3 --ram-budget 4 >"$OUT/ppl.out" 2>&1
expect 'Final estimate: PPL' "$OUT/ppl.out"
step "pi-report"
pi-report "$OUT/activation" "$OUT/predictor" -o "$OUT/report.png" --json "$OUT/report.json" >"$OUT/report.out" 2>&1
[ -s "$OUT/report.png" ] && [ -s "$OUT/report.json" ] || { echo "FAIL: pi-report wrote no figure or table:"; cat "$OUT/report.out"; exit 1; }
echo "   $(head -n 2 "$OUT/report.out" | tail -n 1)"

step "pi-server: start, one request, stop"
PORT=$("$V/python" -c "import socket; s = socket.socket(); s.bind(('127.0.0.1', 0)); print(s.getsockname()[1])")
pi-server -m "$OUT/demo.powerinfer.gguf" --port "$PORT" -c 256 >"$OUT/server.log" 2>&1 &
SERVER=$!
"$V/python" - "$PORT" <<'EOF'
import json, sys, time, urllib.request
base = f"http://127.0.0.1:{sys.argv[1]}"
for _ in range(600):
    try:
        urllib.request.urlopen(base + "/health", timeout=1).read()
        break
    except OSError:
        time.sleep(0.1)
else:
    sys.exit("FAIL: pi-server did not answer /health within 60 s")
req = urllib.request.Request(base + "/v1/completions", method="POST", headers={"Content-Type": "application/json"},
                             data=json.dumps({"prompt": "Once upon a time", "max_tokens": 8, "temperature": 0}).encode())
r = json.loads(urllib.request.urlopen(req, timeout=60).read())
assert r["usage"]["completion_tokens"] == 8, r
print(f"   /v1/completions: {r['choices'][0]['text']!r} ({r['usage']['completion_tokens']} tokens)")
EOF
kill -TERM "$SERVER"
rc=0; wait "$SERVER" || rc=$?
[ "$rc" -eq 0 ] || { echo "FAIL: pi-server exited $rc after SIGTERM:"; cat "$OUT/server.log"; exit 1; }
echo "   stopped (exit 0)"
step "wheel smoke test passed"
