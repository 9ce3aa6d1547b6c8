#!/usr/bin/env bash
# The GPU suite: save and resume bit for bit over tiers x update paths x masters, async save, overlap, read-ahead, kill -9, gpu auto; CUDA unit tests.
# One PASS/FAIL line per case and a summary (gpu_suite.py says what each case is and what it is held to).
#   bash benchmarks/run_gpu.sh gpu_suite             part 1: one GPU (kind nvidia-h200, carry [".whl"]), at most 9 min
#   PART=2 bash benchmarks/run_gpu.sh gpu_suite      part 2: two GPUs (nvidia-h200-x2 or nvidia-h100-x2)
#   CASES=sync bash benchmarks/run_gpu.sh ckpt_scale part 4 GPUs: 13 B TP2 x PP2 (nvidia-h200-x4), its own script
#   DRY_RUN=1 bash benchmarks/experiments/gpu_suite.sh   the same cases, tiny, on the CPU (the gpu tier's stand-in)
# SUITE_COMMIT=<hash> names the commit in the output where there is no .git (the device's copy: its git metadata may
# be stale, so the output also gives the code's fingerprint, which `python benchmarks/tree_fingerprint.py` prints for
# a checkout: the same value, the same code). Give the hash itself: `SUITE_COMMIT=$(git rev-parse ...)` is evaluated
# on the device's copy and names its stale commit (§46). Without SUITE_COMMIT, a tree whose tracked files differ from
# its HEAD says so beside the hash. SEED=N draws the
# tier x update x master cases of an earlier run again. The summary is also written to $OUT/gpu_suite_partN.txt:
# commit it under docs/results/ with the commit it ran at.
set -u
cd "$(dirname "$0")/../.."
export PYTHONUNBUFFERED=1 PYTHONPATH=${PYTHONPATH:-$PWD} PYTHONWARNINGS=ignore
if [ "${DRY_RUN:-0}" = 1 ]; then export OMP_NUM_THREADS=1; else export OMP_NUM_THREADS=${OMP_NUM_THREADS:-2}; fi
if [ -z "${SUITE_COMMIT:-}" ]; then
  SUITE_COMMIT=$(git rev-parse --short HEAD 2>/dev/null || echo unknown)
  if [ "$SUITE_COMMIT" != unknown ] && [ -n "$(git status --porcelain --untracked-files=no 2>/dev/null | head -1)" ]; then
    SUITE_COMMIT="$SUITE_COMMIT with changes to its tracked files (not that commit's code)"
  fi
fi
export SUITE_COMMIT
exec "${PYTHON:-python3}" benchmarks/experiments/gpu_suite.py
