#!/usr/bin/env bash
# The whole pipeline for one published ReLU-sparse model, with its settings:
# calibrate (predictors + activation counts in one layer-streamed pass) -> convert
# (PowerInfer GGUF + dense GGUF) -> run, and optionally a GPU index.
# See recipes/published.md for the table and what to expect.
#
# Usage: bash recipes/published.sh MODEL HF_DIR [OUT_DIR]
#   MODEL   relullama-7b | relullama-13b | relullama-70b | prosparse-7b | prosparse-13b |
#           bamboo-7b | bamboo-7b-dpo | relufalcon-40b | turbosparse-mistral-7b
#           (turbosparse-mistral-7b carries its own predictors: only pi-profile runs, for the
#           sparsity and the GPU index, and pi-convert writes the checkpoint's predictors)
#   HF_DIR  the downloaded Hugging Face folder (config.json, weights, tokenizer)
#   OUT_DIR default out/MODEL (re-runnable: a killed calibration pass resumes at the layer
#           it was in, finished predictors are skipped)
# Environment (optional):
#   DATA=...            calibration text (file, folder, or hf:NAME[:CONFIG]);
#                       default hf:Salesforce/wikitext:wikitext-103-raw-v1 (needs the network once)
#   DEVICE=...          cpu (default), cuda (with NPROC>1: one GPU per process) or cuda:N
#   DTYPE=...           f32 | bf16 | f16, the calibration compute dtype
#                       (default: bf16 on a GPU, f32 on the CPU)
#   NPROC=...           processes (default 1); >1 runs the calibration under
#                       torchrun --standalone --nproc-per-node NPROC (one machine)
#   FORWARD_BATCH=...   sequences of 512 tokens per layer forward (default 8; memory grows with it)
#   PRED_DIR=...        use published predictors (e.g. PowerInfer/ReluLLaMA-7B-Predictor) instead
#                       of training; then only pi-profile runs (PROFILE_TOKENS tokens)
#   VRAM_GIB=...        also write OUT/MODEL.powerinfer.gguf.generated.gpuidx for that GPU budget
#   THREADS=...         CPU threads (default: all; with NPROC>1 on the CPU: cores / NPROC per process)
#   PROFILE_TOKENS=, PREDICTOR_TOKENS=   override the token counts below (e.g. for a quick trial run)
set -euo pipefail
cd "$(dirname "$0")/.."

MODEL=${1:?usage: bash recipes/published.sh MODEL HF_DIR [OUT_DIR]}
HF_DIR=${2:?usage: bash recipes/published.sh MODEL HF_DIR [OUT_DIR]}
OUT=${3:-out/$MODEL}
DATA=${DATA:-hf:Salesforce/wikitext:wikitext-103-raw-v1}
DEVICE=${DEVICE:-cpu}
NPROC=${NPROC:-1}
FORWARD_BATCH=${FORWARD_BATCH:-8}
case "$NPROC" in ''|*[!0-9]*|0) echo "NPROC must be a positive integer, not '$NPROC'" >&2; exit 2;; esac
THREADS_ARG=()
[ -n "${THREADS:-}" ] && THREADS_ARG=(--threads "$THREADS")
DTYPE_ARG=()
[ -n "${DTYPE:-}" ] && DTYPE_ARG=(--dtype "$DTYPE")
CAL_THREADS_ARG=("${THREADS_ARG[@]}")
if [ "$NPROC" -gt 1 ] && [ -z "${THREADS:-}" ] && [ "${DEVICE%%:*}" = cpu ]; then
  # torchrun would give every process 1 thread; share the cores instead
  CAL_THREADS_ARG=(--threads "$(( $(nproc) / NPROC > 0 ? $(nproc) / NPROC : 1 ))")
fi
if [ "$NPROC" -gt 1 ]; then
  LAUNCH=(python -m torch.distributed.run --standalone --nproc-per-node "$NPROC")
  PROFILE=("${LAUNCH[@]}" -m powerinfer.profile.cli)
  TRAIN=("${LAUNCH[@]}" -m powerinfer.train_predictor.cli)
else
  PROFILE=(pi-profile)
  TRAIN=(pi-train-predictor)
fi
CAL_ARGS=(--data "$DATA" --seq-len 512 --forward-batch "$FORWARD_BATCH" --device "$DEVICE"
          "${DTYPE_ARG[@]}" "${CAL_THREADS_ARG[@]}")

OWN_PREDICTORS=
# name | params (B) | n_layer | n_embd | n_ff | vocab | profile tokens | predictor tokens | budget | published sparsity
case "$MODEL" in
  relullama-7b)   P=6.74;  L=32; D=4096; F=11008; V=32000; PROF=131072; PRED=65536; BUDGET=0.09; SPARSITY="~67%";;
  relullama-13b)  P=13.0;  L=40; D=5120; F=13824; V=32000; PROF=131072; PRED=65536; BUDGET=0.09; SPARSITY="~72%";;
  relullama-70b)  P=69.0;  L=80; D=8192; F=28672; V=32000; PROF=65536;  PRED=32768; BUDGET=0.07; SPARSITY="not stated in FORMATS.md (13B: ~72%)";;
  prosparse-7b)   P=6.74;  L=32; D=4096; F=11008; V=32000; PROF=131072; PRED=65536; BUDGET=0.09; SPARSITY="~89% (paper: 89.32%)";;
  prosparse-13b)  P=13.0;  L=40; D=5120; F=13824; V=32000; PROF=131072; PRED=65536; BUDGET=0.09; SPARSITY="~89% (paper: 88.80%)";;
  bamboo-7b|bamboo-7b-dpo)
                  P=7.24;  L=32; D=4096; F=14336; V=32000; PROF=131072; PRED=65536; BUDGET=0.09; SPARSITY="~85-90%";;
  relufalcon-40b) P=41.8;  L=60; D=8192; F=32768; V=65024; PROF=65536;  PRED=32768; BUDGET=0.07; SPARSITY="~95%";;
  turbosparse-mistral-7b)  # its own predictors (mlp.predictor.*): profiled only, converted as published
                  P=7.24;  L=32; D=4096; F=14336; V=32064; PROF=131072; PRED=0;     BUDGET=0;    SPARSITY="~90% (paper)"
                  OWN_PREDICTORS=1;;
  *) echo "unknown MODEL '$MODEL' (see the usage line at the top of $0)" >&2; exit 2;;
esac
PROF=${PROFILE_TOKENS:-$PROF}
PRED=${PREDICTOR_TOKENS:-$PRED}
HELD=$((PRED / 4))
if [ -n "${PRED_DIR:-}" ] || [ -n "${OWN_PREDICTORS:-}" ]; then CAL_TOKENS=$PROF; ROWS_TOKENS=0; else CAL_TOKENS=$((PRED + HELD)); ROWS_TOKENS=$CAL_TOKENS; fi
if [ -n "${THREADS:-}" ]; then CORES=$((THREADS * NPROC)); else CORES=$(nproc); fi

python - "$P" "$L" "$D" "$F" "$V" "$CAL_TOKENS" "$ROWS_TOKENS" "$DEVICE" "${DTYPE:-}" "$NPROC" "$CORES" "$FORWARD_BATCH" <<'EOF'
import sys
p = float(sys.argv[1])
L, D, F, V, tokens, rows = map(int, sys.argv[2:8])
device, dtype, nproc, cores, fb = sys.argv[8], sys.argv[9], int(sys.argv[10]), int(sys.argv[11]), int(sys.argv[12])
gpu = device.startswith("cuda")
dtype = dtype or ("bf16" if gpu else "f32")
b = 4 if dtype == "f32" else 2
layer = (p * 1e9 - 2 * V * D) / L          # parameters per decoder layer
act = 1e9 * (fb * 512 / 4096) * F / 11008  # ~1 GB per 4096 tokens per forward at n_ff 11008 (measured on a 7B shape)
mem = (layer * b + V * D * b + act) / 1e9
where = "GPU memory per GPU" if gpu else "RAM" + (" per process" if nproc > 1 else "")
print(f"== expected memory: ~{mem:.1f} GB {where} ({dtype}, streamed: one decoder layer "
      f"{layer * b / 1e9:.2f} GB + token embeddings {V * D * b / 1e9:.2f} GB + ~{act / 1e9:.1f} GB of "
      f"activations for {fb}x512 tokens per forward)")
print(f"== expected disk: {2 * tokens * D * b / 1e9:.1f} GB of hidden states + "
      f"{rows * L * (2 * D + F / 8) / 1e9:.0f} GB of predictor rows in the work dir, "
      f"then {2 * p:.0f} GB per f16 GGUF (two of them)")
if gpu:
    rate = 80e12 * nproc
    why = f"a projection: ~80 TFLOP/s per GPU, about half of a 24 GB RTX 4090-class card's bf16 peak, x {nproc} GPU(s)"
else:
    rate = 53e9 * cores
    why = (f"assumed ~53 GFLOP/s per core in f32: measured ~106 GFLOP/s, ~250 tokens/s per 7B layer, "
           f"on 2 AVX2 cores; x {cores} cores")
    if dtype != "f32":
        why += f"; {dtype} on a CPU without bf16 instructions is ~8x slower than that"
t = tokens * 2 * p * 1e9 / rate
span = f"{t:.0f} s" if t < 120 else f"{t / 60:.0f} min" if t < 7200 else f"{t / 3600:.1f} h"
print(f"== expected calibration time: ~{span} for {tokens} tokens "
      f"x 2 x {p:g}e9 FLOPs ({why})")
if gpu:
    print("   on a GPU, reading the checkpoint and writing the work files may take longer than the compute")
if rows:
    print(f"   then predictor training: ~{L} layers x a few minutes"
          + (f", layers split over {nproc} processes" if nproc > 1 else ""))
EOF
mkdir -p "$OUT"

if [ -n "${PRED_DIR:-}" ] || [ -n "${OWN_PREDICTORS:-}" ]; then
  echo "== 1/3 pi-profile: $PROF calibration tokens from $DATA on $DEVICE; predictors from" \
       "${PRED_DIR:-the checkpoint itself} (published sparsity: $SPARSITY)"
  "${PROFILE[@]}" "$HF_DIR" "${CAL_ARGS[@]}" --out "$OUT/activation" --max-tokens "$PROF"
  PRED_OUT=${PRED_DIR:-}
else
  echo "== 1/3 pi-train-predictor: $PRED training + $HELD held-out tokens from $DATA on $DEVICE, budget $BUDGET" \
       "of the model's parameters; the same pass writes the profiling counts, over all $((PRED + HELD))" \
       "train+held-out tokens (PROFILE_TOKENS is not used)"
  PRED_OUT=$OUT/predictor
  "${TRAIN[@]}" "$HF_DIR" "${CAL_ARGS[@]}" --out "$PRED_OUT" --work-dir "$OUT/predictor-work" \
    --activation-out "$OUT/activation" --max-tokens "$PRED" --heldout-tokens "$HELD" --budget "$BUDGET"
fi
python -c "import json,sys; s=json.load(open(sys.argv[1])); print(f'measured mean sparsity {100*s[\"mean_sparsity\"]:.1f}% over {s[\"n_tokens\"]} tokens; published: $SPARSITY')" \
  "$OUT/activation/powerinfer_stats.json"

echo "== 2/3 pi-convert: PowerInfer GGUF (f16, what upstream computes with) and a dense GGUF"
DENSE_ARG=()
[ -n "${OWN_PREDICTORS:-}" ] && DENSE_ARG=(--dense)  # else the checkpoint's predictors make it sparse
pi-convert "$HF_DIR" ${PRED_OUT:+"$PRED_OUT"} --outfile "$OUT/$MODEL.powerinfer.gguf" --outtype f16
pi-convert "$HF_DIR" "${DENSE_ARG[@]}" --outfile "$OUT/$MODEL.gguf" --outtype f16

if [ -n "${VRAM_GIB:-}" ]; then
  BYTES=$(python -c "print(int(float('$VRAM_GIB') * 2**30))")
  # neuron capacity: each neuron costs its rows in f16 (gate+up+down = 3 rows, or up+down = 2 rows without a gate)
  ROWS=3; [ "$MODEL" = relufalcon-40b ] && ROWS=2
  CAP=$(python -c "print(int($BYTES * 0.6 // ($D * 2 * $ROWS)))")  # ~60% of VRAM for FFN neurons, the rest for attention/KV
  echo "== GPU index for $VRAM_GIB GiB: capacity $CAP neurons"
  python -m powerinfer --activation "$OUT/activation" --capacity "$CAP" \
    --vram-capacity "$BYTES" --output "$OUT/$MODEL.powerinfer.gguf.generated.gpuidx"
fi

echo "== 3/3 pi-run: sparse generation, then dense for comparison"
pi-run -m "$OUT/$MODEL.powerinfer.gguf" -p "Once upon a time" -n 64 --temp 0 --dtype bf16 "${THREADS_ARG[@]/--threads/-t}"
pi-run -m "$OUT/$MODEL.gguf" -p "Once upon a time" -n 64 --temp 0 --dtype bf16 "${THREADS_ARG[@]/--threads/-t}"
