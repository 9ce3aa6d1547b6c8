#!/usr/bin/env bash
# The CPU's share of the host-held state under --offload-overlap-forward (issue 39 item 4): the 20.68 B README command, A/B in one call.
#   VARIANTS (default "off model share"), each the README command (largest_model.sh, HOST_GB 97) with
#   --offload-overlap-forward --offload-update auto and:
#     off    --offload-cpu-share 0: every host-held subgroup through the GPU (what the overlap did before)
#     model  the time model's choice (mlp_offload/plan/overlap_split.py): where the start-up probe gives the CPU
#            nothing, step 2 times a share of 2 (plan/overlap_steps.py); re-chosen at step 4 once the forward is
#            timed, so iterations 5-8 are its steady ones
#     share  --offload-cpu-share SHARE (default 24): a share forced, so the steps show the CPU's rate beside
#            the streaming GPU under the overlap (the start-up probe's figure, 0.20 G elem/s on an H200, is
#            what the model prices; "offload adam time" over the share's elements is the steps' own)
#   ITERS (default 8) iterations per run, LIMIT_S (default 150) seconds per run (a run takes about 80 s).
# Writes $OUT/cpu_share_2026-11-27/ (copy it to docs/results/): per variant <v>.log (the run's filtered log),
#   <v>_iterations.txt (per iteration: time, host update, CPU Adam, device update, forward wait, predicted
#   iteration), <v>_split.txt (the start-up placement, the split lines with their predicted figures),
#   <v>_telemetry.jsonl, <v>_peaks.txt; summary.txt (all of it, and the wall time of each run).
# Run: bash benchmarks/run_gpu.sh cpu_share_overlap   (device tool, one H200, carry [".whl"]; about 4-5 min)
#   DRY_RUN=1 bash benchmarks/experiments/cpu_share_overlap.sh   (tiny shape on the CPU, 2 iterations)
set -u
OUT=${OUT:-/tmp/out}
RESULTS="$OUT/cpu_share_2026-11-27"; mkdir -p "$RESULTS"
export PYTHONUNBUFFERED=1 PYTHONPATH=${PYTHONPATH:-$PWD}
PY=${PYTHON:-python3}
if [ "${DRY_RUN:-0}" = 1 ]; then ITERS=${ITERS:-2}; LIMIT_S=${LIMIT_S:-300}; else ITERS=${ITERS:-8}; LIMIT_S=${LIMIT_S:-150}; fi
share_flags() {
  case $1 in
    off) echo "--offload-cpu-share 0";;
    model) echo "";;
    share) echo "--offload-cpu-share ${SHARE:-24}";;
    *) echo "unknown variant $1 (off, model or share)" >&2; return 1;;
  esac
}
: > "$RESULTS/summary.txt"
for variant in ${VARIANTS:-off model share}; do
  flags=$(share_flags "$variant") || exit 2
  echo "== $variant: --offload-overlap-forward --offload-update auto $flags" | tee -a "$RESULTS/summary.txt"
  started=$(date +%s)
  HOST_GB=${HOST_GB:-97} ITERS=$ITERS LIMIT_S=$LIMIT_S PORT=${PORT:-29531} \
    EXTRA="--offload-overlap-forward --offload-update auto $flags ${EXTRA_ALL:-}" \
    bash benchmarks/experiments/largest_model.sh > "$RESULTS/.$variant.out" 2>&1
  echo "$variant: $(grep -m1 '^exit ' "$RESULTS/.$variant.out"), wall $(( $(date +%s) - started )) s" | tee -a "$RESULTS/summary.txt"
  mv "$OUT/largest.log" "$RESULTS/$variant.log"
  mv "$OUT/largest_peaks.txt" "$RESULTS/${variant}_peaks.txt"
  mv "$OUT/largest_telemetry.jsonl" "$RESULTS/${variant}_telemetry.jsonl" 2>/dev/null
  rm -f "$RESULTS/.$variant.out"
  grep -E "offload rank [0-9]+:|update split|gpu tier auto" "$RESULTS/$variant.log" | cut -c1-1000 > "$RESULTS/${variant}_split.txt"
  $PY benchmarks/experiments/iteration_summary.py "$RESULTS/$variant.log" > "$RESULTS/${variant}_iterations.txt"
  { cat "$RESULTS/${variant}_split.txt"; cat "$RESULTS/${variant}_iterations.txt"; cat "$RESULTS/${variant}_peaks.txt"; } \
    | tee -a "$RESULTS/summary.txt"
  sleep 2
done
