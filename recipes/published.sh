#!/usr/bin/env bash
# The whole pipeline for one published ReLU-sparse model, with its settings:
# profile -> train predictors -> convert (PowerInfer GGUF + dense GGUF) -> run, and
# optionally a GPU index. See recipes/published.md for the table and what to expect.
#
# Usage: bash recipes/published.sh MODEL HF_DIR [OUT_DIR]
#   MODEL   relullama-7b | relullama-13b | relullama-70b | prosparse-7b | prosparse-13b |
#           bamboo-7b | bamboo-7b-dpo | relufalcon-40b
#   HF_DIR  the downloaded Hugging Face folder (config.json, weights, tokenizer)
#   OUT_DIR default out/MODEL (re-runnable: predictor training resumes)
# Environment (optional):
#   DATA=...            calibration text (file, folder, or hf:NAME[:CONFIG]);
#                       default hf:Salesforce/wikitext:wikitext-103-raw-v1 (needs the network once)
#   PRED_DIR=...        use published predictors (e.g. PowerInfer/ReluLLaMA-7B-Predictor) instead of training
#   VRAM_GIB=...        also write OUT/MODEL.powerinfer.gguf.generated.gpuidx for that GPU budget
#   THREADS=...         CPU threads (default: all)
#   PROFILE_TOKENS=, PREDICTOR_TOKENS=   override the token counts below (e.g. for a quick trial run)
set -euo pipefail
cd "$(dirname "$0")/.."

MODEL=${1:?usage: bash recipes/published.sh MODEL HF_DIR [OUT_DIR]}
HF_DIR=${2:?usage: bash recipes/published.sh MODEL HF_DIR [OUT_DIR]}
OUT=${3:-out/$MODEL}
DATA=${DATA:-hf:Salesforce/wikitext:wikitext-103-raw-v1}
THREADS_ARG=()
[ -n "${THREADS:-}" ] && THREADS_ARG=(--threads "$THREADS")

# name | params (B) | n_layer | n_embd | n_ff | profile tokens | predictor tokens | budget | published sparsity
case "$MODEL" in
  relullama-7b)   P=6.74;  L=32; D=4096; F=11008; PROF=131072; PRED=65536; BUDGET=0.09; SPARSITY="~67%";;
  relullama-13b)  P=13.0;  L=40; D=5120; F=13824; PROF=131072; PRED=65536; BUDGET=0.09; SPARSITY="~72%";;
  relullama-70b)  P=69.0;  L=80; D=8192; F=28672; PROF=65536;  PRED=32768; BUDGET=0.07; SPARSITY="not stated in FORMATS.md (13B: ~72%)";;
  prosparse-7b)   P=6.74;  L=32; D=4096; F=11008; PROF=131072; PRED=65536; BUDGET=0.09; SPARSITY="~89% (paper: 89.32%)";;
  prosparse-13b)  P=13.0;  L=40; D=5120; F=13824; PROF=131072; PRED=65536; BUDGET=0.09; SPARSITY="~89% (paper: 88.80%)";;
  bamboo-7b|bamboo-7b-dpo)
                  P=7.24;  L=32; D=4096; F=14336; PROF=131072; PRED=65536; BUDGET=0.09; SPARSITY="~85-90%";;
  relufalcon-40b) P=41.8;  L=60; D=8192; F=32768; PROF=65536;  PRED=32768; BUDGET=0.07; SPARSITY="~95%";;
  *) echo "unknown MODEL '$MODEL' (see the usage line at the top of $0)" >&2; exit 2;;
esac
PROF=${PROFILE_TOKENS:-$PROF}
PRED=${PREDICTOR_TOKENS:-$PRED}
HELD=$((PRED / 4))

python - "$P" "$L" "$D" "$F" "$PROF" "$PRED" "$HELD" <<'EOF'
import sys
p, L, D, F, prof, pred, held = (float(sys.argv[1]), *map(int, sys.argv[2:]))
flop_per_token = 2 * p * 1e9
print(f"== expected: {4 * p:.0f} GB RAM while profiling/collecting (fp32 weights on CPU), "
      f"{2 * p:.0f} GB for the f16 GGUF, "
      f"{(pred + held) * L * (2 * D + F / 8) / 1e9:.0f} GB disk of collected predictor data")
print(f"== expected time at ~1 TFLOP/s sustained CPU fp32: profile {prof * flop_per_token / 1e12 / 60:.0f} min, "
      f"collection {(pred + held) * flop_per_token / 1e12 / 60:.0f} min, then predictor training "
      f"(~{L} layers x a few minutes)")
EOF
mkdir -p "$OUT"

echo "== 1/4 pi-profile: $PROF calibration tokens from $DATA (published sparsity: $SPARSITY)"
pi-profile "$HF_DIR" --data "$DATA" --out "$OUT/activation" --max-tokens "$PROF" --seq-len 512 --batch-size 4 "${THREADS_ARG[@]}"
python -c "import json,sys; s=json.load(open(sys.argv[1])); print(f'measured mean sparsity {100*s[\"mean_sparsity\"]:.1f}% over {s[\"n_tokens\"]} tokens; published: $SPARSITY')" \
  "$OUT/activation/powerinfer_stats.json"

if [ -n "${PRED_DIR:-}" ]; then
  echo "== 2/4 using the published predictors in $PRED_DIR"
  PRED_OUT=$PRED_DIR
else
  echo "== 2/4 pi-train-predictor: $PRED training + $HELD held-out tokens, budget $BUDGET of the model's parameters"
  PRED_OUT=$OUT/predictor
  pi-train-predictor "$HF_DIR" --data "$DATA" --out "$PRED_OUT" --work-dir "$OUT/predictor-work" \
    --max-tokens "$PRED" --heldout-tokens "$HELD" --seq-len 512 --budget "$BUDGET" "${THREADS_ARG[@]}"
fi

echo "== 3/4 pi-convert: PowerInfer GGUF (f16, what upstream computes with) and a dense GGUF"
pi-convert "$HF_DIR" "$PRED_OUT" --outfile "$OUT/$MODEL.powerinfer.gguf" --outtype f16
pi-convert "$HF_DIR" --outfile "$OUT/$MODEL.gguf" --outtype f16

if [ -n "${VRAM_GIB:-}" ]; then
  BYTES=$(python -c "print(int(float('$VRAM_GIB') * 2**30))")
  # neuron capacity: each neuron costs its rows in f16 (gate+up+down = 3 rows, or up+down = 2 rows without a gate)
  ROWS=3; [ "$MODEL" = relufalcon-40b ] && ROWS=2
  CAP=$(python -c "print(int($BYTES * 0.6 // ($D * 2 * $ROWS)))")  # ~60% of VRAM for FFN neurons, the rest for attention/KV
  echo "== GPU index for $VRAM_GIB GiB: capacity $CAP neurons"
  python -m powerinfer --activation "$OUT/activation" --capacity "$CAP" \
    --vram-capacity "$BYTES" --output "$OUT/$MODEL.powerinfer.gguf.generated.gpuidx"
fi

echo "== 4/4 pi-run: sparse generation, then dense for comparison"
pi-run -m "$OUT/$MODEL.powerinfer.gguf" -p "Once upon a time" -n 64 --temp 0 --dtype bf16 "${THREADS_ARG[@]/--threads/-t}"
pi-run -m "$OUT/$MODEL.gguf" -p "Once upon a time" -n 64 --temp 0 --dtype bf16 "${THREADS_ARG[@]/--threads/-t}"
