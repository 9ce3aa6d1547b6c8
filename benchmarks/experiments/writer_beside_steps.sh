#!/usr/bin/env bash
# A model's steps beside the checkpoint writer in a thread of its process and in a forked process (about 100 s)
# bash benchmarks/run_gpu.sh writer_beside_steps [writer_beside_steps.py's flags]: the 3.0 B determinism shape's
# blocks (28 x 3072, FFN 8192, seq 2048, 8 micro-batches a step, each block recomputed), the writer streaming 8 GB
# of host memory into /var/tmp as the checkpoint writer does; 8 phases of 6 steps: none, thread, process,
# thread_nocopy, thread_dma, none, process, thread (writer_beside_steps.py says what each is).
# DRY_RUN=1: a tiny model on the CPU, 0.3 GB. Output: $OUT/writer_beside_steps.txt.
set -u
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
export PYTHONPATH=${PYTHONPATH:-$PWD} PYTHONWARNINGS=ignore
if [ "${DRY_RUN:-0}" = 1 ]; then
  ARGS="--gb 0.3 --steps 2 --layers 2 --hidden 64 --ffn 128 --heads 2 --seq 64 --micro 2 --device cpu"
else
  ARGS="--gb 8"
fi
python3 benchmarks/experiments/writer_beside_steps.py /var/tmp/writer_beside_steps $ARGS "$@" 2>&1 \
  | tee "$OUT/writer_beside_steps.txt"
