#!/usr/bin/env bash
# 8-bit moments on one H200: the in-HBM updates interleaved with the streamed ones, on the model's buffers, A/B.
# One call, in series on one GPU (issue 39's 20.68 B and 25 B goals), each run largest_model.sh with fp8 moments
# and host 97 GiB (the README's 20.68 B command plus the fp8 flags):
#   20b_fp8         the defaults: held subgroups interleaved, the 8-bit kernel on the model's grads and params
#   20b_fp8_before  --offload-no-interleave --offload-no-update-in-model-buffers: the order and the copies of
#                   the engine before (the same call's baseline)
#   25b_fp8         64 layers (25.36 B), the defaults
#   20b_fp8_overlap the defaults and --offload-overlap-forward (where the call's time is left)
#   bash benchmarks/run_gpu.sh eight_bit_speed        (device tool, kind nvidia-h200, carry [".whl"])
#   RUNS="20b_fp8 20b_fp8_before" ITERS=8 LIMIT=560 ... a subset, fewer iterations, the call's time
#   DRY_RUN=1 bash benchmarks/experiments/eight_bit_speed.sh   (tiny shapes on the CPU)
# Each run gets RUN_LIMIT seconds (default 135; 25b: 160) or what is left of LIMIT; one tar.gz of all at the end.
set -u
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 PYTHONPATH=${PYTHONPATH:-$PWD}
T0=$SECONDS
FP8="--use-precision-aware-optimizer --exp-avg-dtype fp8 --exp-avg-sq-dtype fp8"
stamp() { echo "[$(( SECONDS - T0 )) s] $*"; }
run() {  # $1: name, $2: extra flags, $3: layers, $4: its own limit
  local left=$(( ${LIMIT:-560} - (SECONDS - T0) - 10 )) limit=$4
  [ "$left" -lt "$limit" ] && limit=$left
  [ "$limit" -lt 100 ] && { stamp "skip $1: $left s left"; return; }
  stamp "start $1 (limit $limit s)"
  OUT=$OUT/$1 DISK=/var/tmp/offload_$1 HOST_GB=97 PREC="$FP8" LAYERS=$3 ITERS=${ITERS:-8} LIMIT_S=$limit \
    EXTRA="$2" bash benchmarks/experiments/largest_model.sh > "$OUT/$1.console" 2>&1
  stamp "end $1: $(grep -c 'iteration ' "$OUT/$1/largest.log" 2>/dev/null) iteration lines"
}
LAYERS20=52; LAYERS25=64
[ "${DRY_RUN:-0}" = 1 ] && { LAYERS20=2; LAYERS25=3; }
for name in ${RUNS:-20b_fp8 20b_fp8_before 25b_fp8 20b_fp8_overlap}; do
  case $name in
    20b_fp8) run "$name" "" $LAYERS20 "${RUN_LIMIT:-135}";;
    20b_fp8_before) run "$name" "--offload-no-interleave --offload-no-update-in-model-buffers" $LAYERS20 \
                      "${RUN_LIMIT:-135}";;
    25b_fp8) run "$name" "" $LAYERS25 "${RUN25_LIMIT:-160}";;
    20b_fp8_overlap) run "$name" "--offload-overlap-forward" $LAYERS20 "${RUN_LIMIT:-135}";;
    *) echo "error: RUNS='$RUNS': each one of 20b_fp8, 20b_fp8_before, 25b_fp8, 20b_fp8_overlap"; exit 2;;
  esac
done
stamp "all done"
source benchmarks/experiments/run_summary.sh
summarize_runs "^exit|offload rank 0:|device cuda|rror|Killed" 700 4
pack_runs eight_bit_speed
