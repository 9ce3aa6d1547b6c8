#!/usr/bin/env bash
# --offload-params host on one H200 (issue 50): exactness at 3.0 B, then 20.68 B streamed vs resident.
#   exact  determinism.sh's 3.0 B shape (gb 8, fp8 moments, gpu,host,nvme), --deterministic-mode, 4 iterations: the
#          layer-major step with params resident (L1) and in host memory (P1): losses bit-identical, times side by side
#   20b    largest_model.sh's 20.68 B (gb 1, fp8 moments, gpu tier auto): params resident (host tier 97 GiB) and in
#          host memory (host tier 56 GiB: 41 GiB of params take the rest; the gpu tier takes the HBM they leave)
#   grads  --offload-grads host too: the 3.0 B exactness (P2 against L1), then 20.68 B with params and grads in host
#          memory (host tier 16 GiB: 82 GiB of params and grads beside it) beside params alone
#   bash benchmarks/run_gpu.sh host_params     (device tool, kind nvidia-h200, carry [".whl"]; ~8 min)
#   PARTS=20b ... one part; DRY_RUN=1 bash benchmarks/experiments/host_params.sh (tiny, CPU)
set -u
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
T0=$SECONDS
for part in ${PARTS:-exact 20b}; do
  case $part in
    exact) RUNS="L1 P1" RUN_LIMIT=${RUN_LIMIT:-150} bash benchmarks/experiments/determinism.sh ;;
    20b) RUNS="20b 20b_params" ITERS=${ITERS:-6} RUN_LIMIT=${RUN_LIMIT_20B:-130} LIMIT=${LIMIT_20B:-290} \
           bash benchmarks/experiments/determinism_cost.sh ;;
    grads) RUNS="L1 P2" RUN_LIMIT=${RUN_LIMIT:-150} bash benchmarks/experiments/determinism.sh
           RUNS="20b_params 20b_grads" ITERS=${ITERS:-6} RUN_LIMIT=${RUN_LIMIT_20B:-130} LIMIT=${LIMIT_20B:-290} \
           bash benchmarks/experiments/determinism_cost.sh ;;
  esac
done
echo "host_params: all done at $(( SECONDS - T0 )) s"
