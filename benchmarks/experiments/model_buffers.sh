#!/usr/bin/env bash
# The device's one-pass update on the model's own grads and params (issue 26): bit-identity, rates, 10.24 B A/B.
#   PART=kernel  the kernel's unit tests on the GPU (test_fused_update, test_model_buffers), then update rates
#                (one_pass_rates.py: through copies vs on the model's buffers, resident and streamed)
#   PART=small   gpu_update.sh's correctness runs against megatron-core (fp32 master and remainders, gpu tier
#                and streamed): the model-buffers path is the default, so they check it end to end
#   PART=10b     the 10.24 B shape, bf16 moments, overlapped: on the model's buffers, then through copies
#                (--offload-no-update-in-model-buffers), then on the model's buffers in series; VARIANTS10 picks
# Run: PART=... bash benchmarks/run_gpu.sh model_buffers  (device tool, carry [".whl"]); DRY_RUN=1 runs tiny shapes on CPU.
set -u
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 PYTHONPATH=${PYTHONPATH:-$PWD}
PY=${PYTHON:-python3}
for part in ${PART:-kernel small 10b}; do
  case $part in
    kernel)
      echo "== kernel"
      $PY -m pytest -q -p no:cacheprovider tests/unit/test_fused_update.py tests/unit/test_model_buffers.py 2>&1 \
        | tail -4 | tee "$OUT/kernel_tests.txt"
      $PY benchmarks/experiments/one_pass_rates.py ${NUMEL:-100000000} 2>&1 | grep -v -i warn | tee "$OUT/kernel_rates.txt";;
    small)
      PART=a KINDS=${KINDS:-mcore gpu mcorehalf gpurem streamrem} bash benchmarks/experiments/gpu_update.sh;;
    10b)
      for variant in ${VARIANTS10:-model copies serial}; do
        case $variant in
          model) EXTRA="--offload-overlap-forward";;
          copies) EXTRA="--offload-overlap-forward --offload-no-update-in-model-buffers";;
          serial) EXTRA="";;
        esac
        PART=b STATES=bf16 LABEL=$variant EXTRA="$EXTRA" ITERS_B=${ITERS_B:-8} bash benchmarks/experiments/gpu_update.sh
        $PY benchmarks/experiments/iteration_summary.py "$OUT/10b_bf16_$variant.log" | tee "$OUT/10b_${variant}_summary.txt"
      done;;
  esac
done
