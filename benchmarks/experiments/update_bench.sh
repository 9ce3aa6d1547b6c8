#!/usr/bin/env bash
# One device call: the engine's update phase on the GPU machine (pinned host memory, 16 cores,
# one disk), host-only, one disk path, two paths on the same disk, and disk + an emulated fast
# path on /dev/shm (tmpfs: memory bandwidth, NOT a second device; reported apart).
set -u
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
DISK=${DISK:-/var/tmp/offload}; mkdir -p $DISK
NUMEL=${NUMEL:-1.5e9}
python3 benchmarks/update_bench.py --numel $NUMEL --subgroup-size 1e8 --steps 4 --threads 16 --io-threads 8 \
  --configs host nvme nvme+disk2 nvme+shm --path nvme=$DISK/nvme --path disk2=$DISK/disk2 \
  --path shm=/dev/shm/offload-shm --host-budget-gb 6 --probe-mb 2048 --json $OUT/bench_update.json 2>&1 | tee $OUT/bench_update.log
