#!/usr/bin/env bash
# The layer-major step on the GPU (issue 50): exactness against megatron-core's schedule, then what --offload-activations host costs.
#   1. tests/integration/layer_major_ranks.py on CUDA (fp32 and bf16, --attention-backend local): losses and every
#      gradient bit-identical to megatron-core's schedule, also with each layer's params away while released and
#      its inputs in host memory (HostKeptInputs' streams)
#   2. the 3.0 B shape of determinism.sh (gb 8, fp8 moments, gpu,host,nvme), --deterministic-mode, 4 iterations,
#      with and without --offload-activations host: losses bit-identical, iteration times side by side
#   bash benchmarks/run_gpu.sh layer_major          (device tool, kind nvidia-h200, carry [".whl"]; ~4 min)
#   DRY_RUN=1 bash benchmarks/experiments/layer_major.sh   (the same on the CPU, tiny)
set -u
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 PYTHONWARNINGS=ignore PYTHONPATH=${PYTHONPATH:-$PWD} CUBLAS_WORKSPACE_CONFIG=:4096:8
PY=${PYTHON:-python3}
DEV=cuda; [ "${DRY_RUN:-0}" = 1 ] && DEV=cpu
for precision in fp32 bf16; do
  mkdir -p "$OUT/exact_$precision"
  LAYER_MAJOR_DEVICE=$DEV LAYER_MAJOR_FLAGS="--attention-backend local" timeout 120 \
    $PY -m torch.distributed.run --nproc_per_node 1 --master_port 29581 tests/integration/layer_major_ranks.py \
    "$OUT/exact_$precision" 1 3 "$precision" > "$OUT/exact_$precision.log" 2>&1
  echo "exactness $precision: exit $?"
  $PY - "$OUT/exact_$precision/rank0.json" <<'PY'
import json, sys
try:
    r = json.load(open(sys.argv[1]))
except OSError:
    sys.exit("  no result (see the log)")
print(f"  losses equal {r['losses'] == r['reference_losses']}, grads equal {r['grads_equal']} "
      f"(max diff {r['max_grad_difference']:.3g}); streamed: losses equal {r['streamed_losses'] == r['reference_losses']}, "
      f"grads equal {r['streamed_grads_equal']}, calls in order {r['calls_in_order']}")
PY
done
RUNS="S1 L1" RUN_LIMIT=${RUN_LIMIT:-150} bash benchmarks/experiments/determinism.sh
