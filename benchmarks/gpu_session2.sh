#!/usr/bin/env bash
# Session 1, second device call: GPU checks of checkpoint/resume and the device-aware model.
set -u
OUT=${OUT:-/tmp/out}
bash benchmarks/gpu_pretrain_smoke.sh
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
DISK=/var/tmp/offload
python3 benchmarks/bench_update.py --numel 1.5e9 --subgroup-size 1e8 --steps 3 --threads 16 --io-threads 8 \
  --configs host nvme+disk2 --path nvme=$DISK/nvme --path disk2=$DISK/disk2 --host-budget-gb 6 --probe-mb 2048 \
  --json $OUT/bench_update2.json 2>&1 | tee $OUT/bench_update2.log | tail -4
