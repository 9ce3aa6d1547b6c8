#!/usr/bin/env bash
# Issue 39's one-GPU runs at once on a node of four H200s, each run on a GPU of its own (one call, not four).
#   GPU 0: converge_moments.sh, bf16 moments, 2,000 steps      GPU 1: the same with fp32 moments
#   GPU 2: the README's 20.68 B command (largest_model.sh, host 97 GiB, in series), fp8 moments, then bf16
#   GPU 3: the same 20.68 B with fp8 and --offload-overlap-forward, then 25.36 B (64 layers) with fp8
# Each GPU's runs are one after another; the four GPUs' at once. They share the host's 64 cores, its memory
# (two 97 GiB pinned caches at a time) and its disk, which a node of one H200 does not share: the docs say so
# beside the figures. Each run has its own OUT folder, disk folder and port; at the end one tar.gz holds them.
#   bash benchmarks/run_gpu.sh one_gpu_each      (device tool, kind nvidia-h200-x4, carry [".whl"])
#   DRY_RUN=1 bash benchmarks/experiments/one_gpu_each.sh   (tiny shapes on CPU, no CUDA_VISIBLE_DEVICES)
# CONVERGE_LIMIT (default 530 s), RUN_LIMIT (each 20.68 B run, default 170 s) and RUN25_LIMIT (the 25 B run, default
# 200 s) bound each run.
set -u
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 PYTHONPATH=${PYTHONPATH:-$PWD}
T0=$SECONDS
fp() { echo "--use-precision-aware-optimizer --exp-avg-dtype $1 --exp-avg-sq-dtype $1"; }
on_gpu() { [ "${DRY_RUN:-0}" = 1 ] || export CUDA_VISIBLE_DEVICES=$1; }
stamp() { echo "[$(( SECONDS - T0 )) s] $*"; }

big_run() {  # $1: name, $2: moments, $3: port, $4: limit; EXTRA, LAYERS from the caller
  stamp "start $1"
  OUT=$OUT/$1 DISK=/var/tmp/offload_$1 PORT=$3 HOST_GB=97 PREC="$(fp "$2")" ITERS=${ITERS:-12} LIMIT_S=$4 \
    bash benchmarks/experiments/largest_model.sh > "$OUT/$1.console" 2>&1
  stamp "end $1: $(grep -c 'iteration ' "$OUT/$1/largest.log" 2>/dev/null) iteration lines"
}

# The corpus once for both convergence runs (tokenizing it twice at once would race on its files).
WORK=/var/tmp/converge CORPUS_ONLY=1 bash benchmarks/experiments/converge_moments.sh > "$OUT/corpus.console" 2>&1 &
corpus=$!
( on_gpu 2; big_run 20b_fp8_serial fp8 29611 "${RUN_LIMIT:-170}"; big_run 20b_bf16_serial bf16 29612 "${RUN_LIMIT:-170}" ) &
( on_gpu 3; EXTRA=--offload-overlap-forward big_run 20b_fp8_overlap fp8 29621 "${RUN_LIMIT:-170}"
  LAYERS=64 ITERS=10 big_run 25b_fp8_serial fp8 29622 "${RUN25_LIMIT:-200}" ) &
wait $corpus; stamp "$(tail -1 "$OUT/corpus.console")"
for i in 0 1; do
  variant=$([ $i = 0 ] && echo bf16 || echo fp32)
  ( on_gpu $i; stamp "start converge $variant"
    WORK=/var/tmp/converge VARIANTS=$variant PORT=$(( 29561 + i )) LIMIT=${CONVERGE_LIMIT:-530} OUT=$OUT/converge_$variant \
      bash benchmarks/experiments/converge_moments.sh > "$OUT/converge_$variant.console" 2>&1
    stamp "end converge $variant" ) &
done
wait
stamp "all done"
source benchmarks/experiments/run_summary.sh
summarize_runs "^exit|: exit|offload rank 0:|start-up \(s\)|validation loss|final|rror|Killed|corpus" 420 8
pack_runs one_gpu_each
