#!/usr/bin/env bash
# The one-pass device update (issue 26): its bit-identity on CUDA, its rates, and training runs with and without it.
#   PART=kernel   tests/unit/test_fused_update.py on the GPU, then one_pass_rates.py (multi-pass vs one pass)
#   PART=small    gpu_update.sh's correctness runs (megatron-core vs ours, gpu tier and streamed, fp32 master
#                 and remainders): the one-pass kernel is on by default, so they check it end to end
#   PART=10b      the 10.24 B shape, bf16 moments, README command: one pass, then --offload-no-one-pass-update
#                 (VARIANTS="onepass overlap": without and with --offload-overlap-forward)
#   PART=20b      the 20.68 B README command (largest_model.sh)
#   PART=peers3b  3.0 B host only against megatron-core's CPU offload (benchmarks/peers.py --systems af)
# Run: bash benchmarks/run_gpu.sh one_pass_update   (device tool, carry [".whl"]); DRY_RUN=1 runs tiny shapes on CPU.
set -u
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 PYTHONPATH=${PYTHONPATH:-$PWD}
PY=${PYTHON:-python3}
for part in ${PART:-kernel small}; do
  case $part in
    kernel)
      echo "== kernel: bit-identity on this device, then rates"
      $PY -m pytest -q -p no:cacheprovider tests/unit/test_fused_update.py 2>&1 | tail -5 | tee "$OUT/kernel_tests.txt"
      $PY benchmarks/experiments/one_pass_rates.py ${NUMEL:-100000000} 2>&1 | grep -v -i warn | tee "$OUT/kernel_rates.txt";;
    small)
      PART=a KINDS=${KINDS:-mcore gpu mcorehalf gpurem streamrem} bash benchmarks/experiments/gpu_update.sh;;
    10b)
      for variant in ${VARIANTS:-onepass multipass}; do
        EXTRA=""; [ $variant = multipass ] && EXTRA="--offload-no-one-pass-update"
        [ $variant = overlap ] && EXTRA="--offload-overlap-forward"
        PART=b STATES=bf16 LABEL=$variant EXTRA="$EXTRA" bash benchmarks/experiments/gpu_update.sh
      done;;
    20b)  # EXTRA20B: more flags (e.g. --offload-overlap-forward)
      EXTRA="${EXTRA20B:-}" bash benchmarks/experiments/largest_model.sh;;
    peers3b)  # 3.0 B, host only (ours) against megatron-core's optimizer_cpu_offload, one call
      SHAPE3B=${SHAPE3B:---layers 28 --hidden 3072 --ffn 8192 --heads 24 --kv-heads 8}
      $PY benchmarks/peers.py --systems af $SHAPE3B --micro-batch 1 --host-budget-gb 5.96 --iters ${ITERS3B:-4} \
        --disk-dir /var/tmp/offload_cmp --shm-dir /dev/shm/offload_cmp --out "$OUT" --budget-s ${BUDGET3B:-300} \
        ${PEERS_FLAGS:-} 2>&1 | grep -v -i warn | tail -25 | tee "$OUT/peers3b.txt"
      rm -rf /var/tmp/offload_cmp /dev/shm/offload_cmp "$OUT"/logs.tar.gz;;
  esac
done
