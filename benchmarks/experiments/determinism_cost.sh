#!/usr/bin/env bash
# What --deterministic-mode costs, and whether the update split settles; one call on one H200, in series:
#   10b, 10b_det   10.24 B (36 layers, hidden 5120, FFN 13824, 40 heads), fp8 moments, host 74 GiB, without and with
#                  the mode (largest_model.sh: gpu,host,nvme, gpu tier auto, SDPA, global batch 1)
#   20b, 20b_det   20.68 B (52 layers, hidden 6144, FFN 16384, 48 heads), fp8 moments, host 97 GiB, likewise
#   quickstart     the README's quickstart on the GPU (offline: the wheelhouse .whl/), its "update split" lines in
#                  the first 20 iterations counted
#   bash benchmarks/run_gpu.sh determinism_cost    (device tool, kind nvidia-h200, carry [".whl"])
#   RUNS="10b 10b_det" ITERS=6 LIMIT=560 ...; DRY_RUN=1 bash benchmarks/experiments/determinism_cost.sh (tiny, CPU)
set -u
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 PYTHONPATH=${PYTHONPATH:-$PWD}
T0=$SECONDS
FP8="--use-precision-aware-optimizer --exp-avg-dtype fp8 --exp-avg-sq-dtype fp8"
stamp() { echo "[$(( SECONDS - T0 )) s] $*"; }
source benchmarks/experiments/iteration_lines.sh
run() {  # NAME LAYERS HIDDEN FFN HEADS HOST_GB [extra flags]
  local name=$1 layers=$2 hidden=$3 ffn=$4 heads=$5 host=$6; shift 6
  local left=$(( ${LIMIT:-560} - (SECONDS - T0) - 10 )) limit=${RUN_LIMIT:-110}
  [ "$left" -lt "$limit" ] && limit=$left
  [ "$limit" -lt 60 ] && { stamp "skip $name: $left s left"; return; }
  [ "${DRY_RUN:-0}" = 1 ] && layers=2
  stamp "start $name (limit $limit s)"
  OUT=$OUT/$name DISK=/var/tmp/offload_$name HOST_GB=$host PREC="$FP8" LAYERS=$layers HIDDEN=$hidden FFN=$ffn \
    HEADS=$heads ITERS=${ITERS:-8} LIMIT_S=$limit EXTRA="$*" bash benchmarks/experiments/largest_model.sh \
    > "$OUT/$name.console" 2>&1
  stamp "end $name"
  grep -E "deterministic mode|update split|rror" "$OUT/$name/largest.log" | cut -c1-300
  iteration_lines "$OUT/$name/largest.log"
}
for name in ${RUNS:-10b 10b_det 20b 20b_det quickstart}; do
  case $name in
    10b) run 10b 36 5120 13824 40 74 ;;
    10b_det) run 10b_det 36 5120 13824 40 74 --deterministic-mode ;;
    20b) run 20b 52 6144 16384 48 97 ;;
    20b_det) run 20b_det 52 6144 16384 48 97 --deterministic-mode ;;
    20b_params) run 20b_params 52 6144 16384 48 56 --offload-params host ;;  # host_params.sh's: 41 GiB of params on host
    20b_grads) run 20b_grads 52 6144 16384 48 16 --offload-params host --offload-grads host ;;  # and 41 GiB of grads
    quickstart)
      stamp "start quickstart"
      RUN_DIR=/var/tmp/quickstart MLP_OFFLOAD_WHEELHOUSE=$PWD/.whl TRAIN_ITERS=20 timeout 200 \
        bash examples/quickstart.sh --log-interval 1 > "$OUT/quickstart.log" 2>&1
      stamp "end quickstart: exit $?; $(grep -c 'update split' "$OUT/quickstart.log") update split line(s) in 20 iterations"
      grep -E "update split|rror" "$OUT/quickstart.log" | cut -c1-300 | head -20
      rm -rf /var/tmp/quickstart ;;
  esac
done
stamp "all done"
