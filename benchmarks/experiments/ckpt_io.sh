#!/usr/bin/env bash
# One engine's offloaded state saved and loaded against the disk's O_DIRECT floor (twice each).
#   bash benchmarks/run_gpu.sh ckpt_io [DIR] [GB]     (device tool, carry [".whl"]; about a minute for 6 GB)
#   python3 benchmarks/experiments/ckpt_io.py /var/tmp/ckpt_io 1.8   (CPU)
set -u
cd "$(dirname "$0")/../.."
exec "${PYTHON:-python3}" benchmarks/experiments/ckpt_io.py "$@"
