#!/usr/bin/env bash
# What each way of copying memory-held state aside in a thread costs the GPU steps beside it (copy_aside_interference.py)
#   bash benchmarks/run_gpu.sh copy_aside_interference     (device tool, kind nvidia-h200, carry [".whl"])
set -u
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
python3 benchmarks/experiments/copy_aside_interference.py "$@" 2>&1 | tee "$OUT/copy_aside_interference.txt"
