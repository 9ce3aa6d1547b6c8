#!/usr/bin/env bash
# One device call: the engine's update rates for a 2 G-param shard, bf16 and fp32 moments: CPU Adam on host
# state, the GPU on streamed host state (three streams), the GPU on resident state, and the auto split.
# Dry run on CPU: DRY_RUN=1 bash benchmarks/experiments/gpu_update_bench.sh
set -u
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 PYTHONPATH=${PYTHONPATH:-$PWD}
if [ "${DRY_RUN:-0}" = 1 ]; then ARGS="--numel 2e6 --subgroup-size 5e5 --device cpu"; else ARGS="--numel ${NUMEL:-2e9} --device cuda"; fi
${PYTHON:-python3} benchmarks/experiments/device_update_rates.py $ARGS --json "$OUT/device_update_rates.json" 2>&1 \
  | grep -v -i warn | tee "$OUT/device_update_rates.log"
