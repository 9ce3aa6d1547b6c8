#!/usr/bin/env bash
# --deterministic-mode with the default attention (SDPA) on one H200: the same command twice, a save and resume.
# 3.0 B Llama (28 layers, hidden 3072, FFN 8192, 24 heads, 8 groups, seq 2048, mb 1, gb 8), fp8 moments,
# gpu 4 GiB / host 4 GiB / nvme, cosine LR, clip 1.0, mock data, seed 1234, 4 iterations (issue 49's table):
#   D1  --deterministic-mode, a synchronous save at 2 (its rate beside the disk's floor measured first)
#       (the save's line: each part's GB, s and GB/s; the summary: the save's and DR's load's GB/s against the
#       floor's write and read rates of the same call, and whether each is >= 80% of it: save_rate.py)
#   D2  --deterministic-mode again, no save: must equal D1 bit for bit
#   DR  --deterministic-mode, resumed from D1's save at 2 (page cache dropped): iterations 3-4 must equal D1's
#   N1, N2  without the mode, twice: the nondeterminism the mode removes, and the mode's cost at this size
#   S1, L1  (only when RUNS names them) --deterministic-mode without and with --offload-activations host
#   P1  (only when RUNS names it) L1 with --offload-params host: the params in host memory, a layer at a time on the GPU
#   P2  (only when RUNS names it) P1 with --offload-grads host: the grads in host memory too
#   A1  (only when RUNS names it) --async-save at 2 and 4 of 6 iterations: each save's hold, the steps beside its writer
#   A2, B2  (only when RUNS names them) --async-save at 4 and 8 of 8 iterations, and the same without saves: the
#       iterations beside the paced writer against B2's (goal <= 1.25x), each save's hold (goal <= 0.5 s), the pacing
#       lines, the disk's scheduler, and per iteration the disk's bytes, the node's CPU and page faults (the rank's
#       and its descendants' apart), the rank's memory by kind (private and shared dirty: rank_maps.py) and the
#       engine's trace summed (its tier operations against its update's phases, where its training thread waited:
#       beside_writer.py)
#   A3  (only when RUNS names it) A2 with --no-resume-check: what the digests' CPU work costs the steps beside the writer
#   A8, B8  (only when RUNS names them) A2 and B2 with saves 8 iterations apart: --async-save at 8 and 16 of 16
#   A16, B16  (only when RUNS names them) A8 and B8 with saves 16 iterations apart: --async-save at 16 and 32 of 32;
#       the paced writer spread over twice the steps (RUN_LIMIT=260)
#   A8L  (only when RUNS names it) A8 run for 32 iterations, against B16: three writers' spans (after the saves at 8,
#       16 and 24) in one run, where A8 has one or two (RUNS="B16 A8L" RUN_LIMIT=260, about 550 s); it keeps only
#       the newest complete checkpoint (--save-retain-interval 1000), as four of 18.28 GB beside the nvme tier's
#       files pass a 64 GB disk (the save at 32 was refused there for space)
#   the summary also reads every A8 and B8 run's steps 9-14 against its own steps 3-7 (first_step_copy.py --own;
#       pooled over many calls: pooled_own_steps.py)
#   A2_<variant>, A3_<variant>, A8_<variant>, A16_<variant>  that run on a copy of this tree with
#       benchmarks/variants/<variant>.patch applied (a rule of the product measured against main's in one call, on
#       one machine), against B2, B8 or B16; where benchmarks/variants/<variant>.flags is there instead, that run on
#       this tree with the file's flags added (a flag's cost measured in one call: A8_no_resume_check)
#   bash benchmarks/run_gpu.sh determinism     (device tool, kind nvidia-h200, carry [".whl"])
#   RUNS="D1 D2 DR" ... a subset; DRY_RUN=1 bash benchmarks/experiments/determinism.sh (tiny, CPU)
#   A8_persistent_worker: A8 with --use-persistent-ckpt-worker (torch_dist's files written by a worker forked at
#       start-up, not a fork per save: the first steps after a save without the fork's copy-on-write faults);
#       RUNS="B8 A8 A8_persistent_worker" RUN_LIMIT=200 CALL_BUDGET_S=540 (about 510 s)
#   (A2_staging_4k_pages: the snapshot's staging in 4 KiB pages, as before fa8ee57)
#   (A8_writer_cpu_only, §52: the offloaded state's writer copies and CRCs its pieces but does not write them)
#   (A8_writer_in_threads, §53: the offloaded state's CRCs and writes by threads of the rank, as before 0ffaf9c, where
#   main's are made by a helper process)
#   (retired variants, measured in §41-47: device_digest, freeze_at_save, writer_process, paced_pieces (§47: the
#   forward and backward beside the writer kept their extra switches); merged: flush_first (§46), direct_writes (§50: torch_dist's files on the disk as
#   they are written, paced, by O_DIRECT), keep_staging (§48:
#   the staging of the state held in memory made and faulted in at start-up, kept from save to save))
#   (each A run is read against its B run of the same call; "iterations 2-8 together" below 1 says that B run was
#       slower before the first save too, which flatters the ratios after it)
#   NAME-K (K a digit), e.g. RUNS="B8 A8 B8-2 A8-2": the K-th run of NAME, against the K-th of its base (A8-2 against
#       B8-2, A8_<variant>-2 too; where B8-2 is not run, against B8, so RUNS="B8 A8 A8-2" reads one code twice
#       against one base): two runs of one command differ by about 0.2 a step on the device's disk (§39), so a
#       pair run twice shows whether a difference is larger than that; with B8-2 run, A8 against B8 also reads
#       B8-2 against B8 over the same steps (beside_writer.py --repeat): the noise of the statistic itself
#   FLOOR_GB=4 RUNS="B8 A8 B8-2" RUN_LIMIT=200 ...  (about 420 s) main's A8 beside that noise
#   FLOOR_GB=4 RUNS="B8 A8 A8-2" RUN_LIMIT=200 CALL_BUDGET_S=540 ...  (about 510 s: the floor, B8 and A8 took 336 s
#       on 2026-12-02, and CALL_BUDGET_S=500 left A8-2 out) and RUNS="B16 A16" RUN_LIMIT=260 (about 460 s):
#       main read again (goal_readings.py gathers the runs); since the kept staging (§48) main's own A8 has two
#       runs, both of §48's call 3, in a call whose B8 was slow before the first save
#   CALL_BUDGET_S (default 550): a run is not begun where the time used and the longest run so far pass it
#   PROFILE_STEP=N: the A and B runs profile iteration N (--profile --profile-dir: torch.profiler, CPU and CUDA
#       events), and profile_diff.py reads each A run's threads against its base's in that iteration
#       (determinism_profile_<run>.txt): what the training thread does more in, e.g., the first step after a save
#       (N=9 at saves 8 apart). Iteration N's times then carry the profiler's cost in both runs, and the trace's
#       export pauses the loop after it while the background writers go on (the steps after N read a little fast)
#   FLOOR_GB=4 PROFILE_STEP=9 RUNS="B8 A8 A8-2" RUN_LIMIT=200 ...  (about 450 s) the first step after the save,
#       the worst in three of §47's five main runs, its training thread 0.37-0.89 s longer on a core
# Raw samples, traces, loss logs and the last run's whole log go into $OUT/raw.tgz.
set -u
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 PYTHONWARNINGS=ignore PYTHONPATH=${PYTHONPATH:-$PWD}
DISK=${DISK:-/var/tmp/determinism}; rm -rf "$DISK"; mkdir -p "$DISK/nvme"
PY=${PYTHON:-python3}
if [ "${DRY_RUN:-0}" = 1 ]; then
  SHAPE="--num-layers 2 --hidden-size 64 --ffn-hidden-size 128 --num-attention-heads 4 --num-query-groups 2
    --seq-length 64 --max-position-embeddings 64 --device cpu"
  TIERS="--offload-gpu-cache-gb 0.0004 --offload-host-cache-gb 0.0004"; SUB=6000; FLOOR_GB=0.05
else
  SHAPE="--num-layers 28 --hidden-size 3072 --ffn-hidden-size 8192 --num-attention-heads 24 --num-query-groups 8
    --seq-length 2048 --max-position-embeddings 2048 --device cuda"
  TIERS="--offload-gpu-cache-gb 4 --offload-host-cache-gb 4"; SUB=100000000; FLOOR_GB=${FLOOR_GB:-8}
  nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
  echo "transparent huge pages: $(cat /sys/kernel/mm/transparent_hugepage/enabled 2>/dev/null), defrag $(cat /sys/kernel/mm/transparent_hugepage/defrag 2>/dev/null)"
  echo "dirty page age before the kernel writes them back: $(cat /proc/sys/vm/dirty_expire_centisecs) cs; its flusher wakes every $(cat /proc/sys/vm/dirty_writeback_centisecs) cs"
  df -h /dev/shm | tail -1 | awk '{print "/dev/shm: " $2 " (" $4 " free): the room for A8_writer_process'"'"'s shared copies"}'
fi
COMMON="$SHAPE --group-query-attention --swiglu --normalization RMSNorm --position-embedding-type rope
  --untie-embeddings-and-output-weights --disable-bias-linear --hidden-dropout 0 --attention-dropout 0
  --vocab-size 32000 --micro-batch-size 1 --global-batch-size 8 --train-iters 4 --lr 3e-4 --min-lr 3e-5
  --lr-decay-style cosine --lr-warmup-iters 1 --adam-beta2 0.95 --weight-decay 0.1 --clip-grad 1.0 --bf16
  --mock-data --seed 1234 --log-interval 1 --recompute-granularity full --recompute-method uniform
  --recompute-num-layers 1 --use-precision-aware-optimizer --exp-avg-dtype fp8 --exp-avg-sq-dtype fp8
  --offload-tiers gpu,host,nvme $TIERS --offload-nvme-path $DISK/nvme --offload-subgroup-size $SUB
  --offload-io-threads 8"
T0=$SECONDS
$PY - "$DISK" "$FLOOR_GB" <<'PY' | tee "$OUT/determinism_floor.txt"
import sys
from benchmarks.io_floor import file_bandwidth
f = file_bandwidth(sys.argv[1], int(float(sys.argv[2]) * 2**30))
print(f"disk floor {f['path']}: {f['bytes'] / 1e9:.1f} GB, O_DIRECT {f['odirect']}, {f['threads']} threads: "
      f"write {f['write_gbps']:.2f} GB/s, read {f['read_gbps']:.2f} GB/s")
PY
drop_page_cache() {
  [ "${DRY_RUN:-0}" = 1 ] && return
  sync; echo 3 > /proc/sys/vm/drop_caches 2>/dev/null && echo "page cache dropped" || echo "page cache NOT dropped"
}
vm_counts() {  # the kernel's memory compaction and transparent huge page counts so far, "name value ..."
  grep -E "^(compact_stall|compact_fail|compact_success|thp_fault_alloc|thp_fault_fallback) " /proc/vmstat 2>/dev/null | tr '\n' ' '
}
vm_delta() {  # BEFORE AFTER: each count's growth between two vm_counts
  awk -v a="$1" -v b="$2" 'BEGIN { n = split(a, x, " "); split(b, y, " ")
    for (i = 1; i < n; i += 2) printf "%s +%d%s", x[i], y[i + 1] - x[i + 1], (i + 2 < n ? ", " : "\n") }'
}
stamp_epoch() { $PY -u -c 'import sys, time
for line in sys.stdin: sys.stdout.write(f"[{time.time():.3f}] {line}")'; }
run() {  # NAME [flags]
  local name=$1; shift
  local code watcher="" trace="" vm_before
  vm_before=$(vm_counts)
  case ${name%%[_-]*} in  # A2 and B2: lines stamped, the disk sampled and the engine traced, for beside_writer.py
    A2|A3|B2|A8|B8|A16|B16) mkdir -p "$OUT/raw"; $PY benchmarks/experiments/disk_watch.py "$DISK" "$OUT/raw/disk_$name.txt" & watcher=$!
              $PY benchmarks/experiments/thread_waits.py "$OUT/raw/waits_$name.txt" & watcher="$watcher $!"
              $PY benchmarks/experiments/rank_maps.py "$OUT/raw/maps_$name.txt" & watcher="$watcher $!"
              trace="--offload-trace $OUT/raw/trace_$name.json"
              [ -n "${PROFILE_STEP:-}" ] && trace="$trace --profile --profile-step-start $(( PROFILE_STEP - 1 ))
                --profile-step-end $PROFILE_STEP --profile-dir $OUT/raw/profile_$name" ;;
  esac
  # shellcheck disable=SC2086
  timeout "${RUN_LIMIT:-170}" torchrun --nproc_per_node 1 --master_port "${PORT:-29561}" pretrain_gpt.py $COMMON "$@" ${RUN_FLAGS:-} $trace \
    --loss-log "$OUT/$name.jsonl" 2>&1 | if [ -n "$watcher" ]; then stamp_epoch; else cat; fi > "$OUT/.run.log"
  code=${PIPESTATUS[0]}
  # shellcheck disable=SC2086
  if [ -n "$watcher" ]; then kill $watcher; wait $watcher 2>/dev/null; fi
  echo "$name exit $code at $(( SECONDS - T0 )) s"
  grep -v -i warn "$OUT/.run.log" | grep -E "deterministic|attention:|checkpoint|resume|iteration +[0-9]+/|update split|rror|Killed|> params|offloaded state .*linked|paced|--async-save: " \
    | cut -c1-900 > "$OUT/determinism_$name.log"
  # a first save's copy aside slowed by compaction for huge pages would show here (§45)
  [ -n "$vm_before" ] && echo "$name: memory compaction and huge pages over the run: $(vm_delta "$vm_before" "$(vm_counts)")" \
    >> "$OUT/determinism_$name.log"
  grep -v "iteration  " "$OUT/determinism_$name.log" | cut -c1-900
  source benchmarks/experiments/iteration_lines.sh; iteration_lines "$OUT/determinism_$name.log"
}
variant_tree() {  # VARIANT: a copy of this tree with benchmarks/variants/VARIANT.patch applied; prints its path
  local tree=/tmp/determinism_variant_$1 patch=$PWD/benchmarks/variants/$1.patch
  [ -f "$patch" ] || { echo "no variant $1 ($patch)" >&2; return 1; }
  rm -rf "$tree"; mkdir -p "$tree"
  tar --exclude=./.git --exclude=./.whl --exclude=./.deb --exclude=./docs -cf - . | tar -xf - -C "$tree"
  if command -v git >/dev/null; then (cd "$tree" && git apply "$patch") >&2
  else patch -d "$tree" -p1 -s < "$patch" >&2; fi || { echo "variant $1: $patch does not apply to this tree" >&2; return 1; }
  echo "$tree"
}
run_case() {  # NAME: the run of that name (A8_<variant>, A8-2: A8's flags, its own name)
  local name=$1
  case ${name%%[_-]*} in
    D1) run "$name" --deterministic-mode --save "$DISK/ckpt" --save-interval 2 ;;
    D2) run "$name" --deterministic-mode ;;
    DR) mkdir -p "$DISK/at2" && cp -al "$DISK/ckpt/iter_0000002" "$DISK/at2/" && echo 2 > "$DISK/at2/latest_checkpointed_iteration.txt"
        rm -rf "$DISK/ckpt/iter_0000004"; drop_page_cache
        run "$name" --deterministic-mode --load "$DISK/at2" ;;
    N1|N2) run "$name" ;;
    A1) run "$name" --async-save --save "$DISK/async" --save-interval 2 --train-iters 6 ;;  # holds, steps beside the writer
    A2) echo "scheduler of $DISK: $($PY -c "import sys; from megatron.training.runtime.io_priority import scheduler_of; print(scheduler_of(sys.argv[1]))" "$DISK")"
        run "$name" --async-save --save "$DISK/paced" --save-interval 4 --train-iters 8; rm -rf "$DISK/paced" ;;
    A3) run "$name" --async-save --save "$DISK/paced" --save-interval 4 --train-iters 8 --no-resume-check
        rm -rf "$DISK/paced" ;;  # A2 without the resume check's digests (their CPU work beside the steps)
    B2) run "$name" --train-iters 8 ;;  # A2 without saves
    A8) run "$name" --async-save --save "$DISK/paced" --save-interval 8 --train-iters 16; rm -rf "$DISK/paced" ;;
    B8) run "$name" --train-iters 16 ;;  # A8 without saves
    A16) run "$name" --async-save --save "$DISK/paced" --save-interval 16 --train-iters 32; rm -rf "$DISK/paced" ;;
    B16) run "$name" --train-iters 32 ;;  # A16 and A8L without saves
    A8L) run "$name" --async-save --save "$DISK/paced" --save-interval 8 --save-retain-interval 1000 \
             --train-iters 32; rm -rf "$DISK/paced" ;;
    S1) run "$name" --deterministic-mode ;;  # layer_major.sh's pair
    L1) run "$name" --deterministic-mode --offload-activations host ;;
    P1) run "$name" --deterministic-mode --offload-activations host --offload-params host ;;
    P2) run "$name" --deterministic-mode --offload-activations host --offload-params host --offload-grads host ;;
  esac
}
# A run that would pass the call's time is not begun, so the runs done are still read (a device call stops at 600 s,
# this script's set-up before T0 included)
longest=0
for name in ${RUNS:-D1 D2 DR N1 N2}; do
  used=$(( SECONDS - T0 ))
  if [ "$longest" -gt 0 ] && [ $(( used + longest )) -gt "${CALL_BUDGET_S:-550}" ]; then
    echo "$name: not run: $used s used and the longest run so far took $longest s, past CALL_BUDGET_S=${CALL_BUDGET_S:-550}"
    continue
  fi
  begun=$SECONDS
  variant=${name#*_}; variant=${variant%-[0-9]*}  # A8_<variant>-2: the variant's second run
  if [ "$name" = "${name%%_*}" ]; then run_case "$name"
  elif [ -f "benchmarks/variants/$variant.flags" ]; then  # a flags variant: this tree, those flags added
    echo "$name: A run of ${name%%[_-]*} with $(cat "benchmarks/variants/$variant.flags")"
    RUN_FLAGS=$(cat "benchmarks/variants/$variant.flags") run_case "$name"
  else
    if tree=$(variant_tree "$variant"); then
      echo "$name: A run of ${name%%[_-]*} on $tree (benchmarks/variants/$variant.patch applied)"
      (cd "$tree" && export PYTHONPATH=${PYTHONPATH/$PWD/$tree} && run_case "$name")
      rm -rf "$tree"
    fi
  fi
  [ $(( SECONDS - begun )) -gt "$longest" ] && longest=$(( SECONDS - begun ))
done
du -sh "$DISK/at2" 2>/dev/null | cat
for log in "$OUT"/determinism_A[238]*.log "$OUT"/determinism_A16*.log; do
  [ -e "$log" ] || continue  # an unmatched glob
  async=$(basename "$log" .log); async=${async#determinism_}
  case ${async%%[_-]*} in A8) base=B8 ;; A16|A8L) base=B16 ;; *) base=B2 ;; esac
  case $async in *-[0-9]*) base=$base-${async##*-} ;; esac  # a repeat against the repeat of its base
  if [ ! -s "$OUT/determinism_$base.log" ] && [ "$base" != "${base%-[0-9]*}" ] && [ -s "$OUT/determinism_${base%-[0-9]*}.log" ]; then
    echo "$async: ${base} not run, so against ${base%-[0-9]*}"  # RUNS="B8 A8 A8-2": both repeats against one B8
    base=${base%-[0-9]*}
  fi
  if [ ! -s "$OUT/determinism_$base.log" ] && [ "${base%%-*}" = B8 ] && [ -s "$OUT/determinism_B16${base#B8}.log" ]; then
    base=B16${base#B8}  # B8 not run: B16's first 16 iterations, the same flags but --train-iters 32 (its LR differs)
    echo "$async: B8 not run, so against ${base}'s first 16 iterations (the same flags but --train-iters 32)"
  fi
  repeat=()  # B8-2 beside B8: two runs without saves, the noise of A8's figures
  case $async in *-[0-9]*) ;; *) [ -s "$OUT/determinism_$base-2.log" ] && repeat=(--repeat "$OUT/determinism_$base-2.log") ;; esac
  if [ -s "$OUT/determinism_$async.log" ] && [ -s "$OUT/determinism_$base.log" ]; then
    echo "$async against $base:"
    $PY benchmarks/experiments/beside_writer.py "$OUT/determinism_$async.log" "$OUT/determinism_$base.log" \
      --disk "$OUT/raw/disk_$async.txt" "$OUT/raw/disk_$base.txt" --trace "$OUT/raw/trace_$async.json" \
      "$OUT/raw/trace_$base.json" --waits "$OUT/raw/waits_$async.txt" "$OUT/raw/waits_$base.txt" \
      --maps "$OUT/raw/maps_$async.txt" "$OUT/raw/maps_$base.txt" "${repeat[@]}" | tee "$OUT/determinism_beside_writer_$async.txt"
  fi
  if [ -s "$OUT/raw/profile_$async/profile_rank0.json" ] && [ -s "$OUT/raw/profile_$base/profile_rank0.json" ]; then
    echo "$async against $base, iteration $PROFILE_STEP under torch.profiler:"
    $PY benchmarks/experiments/profile_diff.py "$OUT/raw/profile_$async/profile_rank0.json" \
      "$OUT/raw/profile_$base/profile_rank0.json" | tee "$OUT/determinism_profile_$async.txt"
  fi
done
$PY - "$OUT" <<'PY' | tee "$OUT/determinism_summary.txt"
import json, os, sys
out = sys.argv[1]
def losses(name):
    path = f"{out}/{name}.jsonl"
    return {r["iteration"]: r for r in map(json.loads, open(path))} if os.path.exists(path) else {}
runs = {n: losses(n) for n in ("D1", "D2", "DR", "N1", "N2", "S1", "L1", "P1", "P2")}
for it in sorted(runs["D1"] or runs["N1"]):
    print(f"iteration {it}: " + "  ".join(f"{n} {r[it]['loss']:.6f}" for n, r in runs.items() if it in r))
def same(a, b, its=None):
    its = [i for i in (its or sorted(runs[a])) if i in runs[b]]
    return bool(its) and all(runs[a][i] == runs[b][i] for i in its), its
for a, b in (("D1", "D2"), ("D1", "DR"), ("N1", "N2"), ("D1", "N1"), ("S1", "L1"), ("L1", "P1"), ("L1", "P2")):
    if not (runs[a] and runs[b]):
        continue  # one of the pair not run (RUNS)
    ok, its = same(a, b)
    print(f"{a} vs {b} over iterations {its}: {'bit-identical (loss, lr, grad norm)' if ok else 'DIFFER'}")
PY
for report in "$OUT"/determinism_beside_writer_*.txt; do  # each run with saves: its goal lines, one place
  [ -s "$report" ] || continue
  name=${report##*/determinism_beside_writer_}; echo "${name%.txt}:"
  grep -E "^(longest hold|worst iteration|iterations [0-9-]+ beside the writer against the median|iterations [0-9-]+ \(after the first save\) together)" "$report" | sed 's/^/  /'
done | tee -a "$OUT/determinism_summary.txt"
own=()  # first save at 8 (or none, B16 beside A8L): each run's steps after it against its own steps before it
for log in "$OUT"/determinism_[AB]8*.log "$OUT"/determinism_B16*.log; do [ -e "$log" ] && own+=("$log"); done
if [ ${#own[@]} -gt 0 ]; then
  echo "each run's steps 9-14 against its own steps 3-7 (a run without saves: the drift with no writer at all):"
  $PY benchmarks/experiments/first_step_copy.py --own "${own[@]}" | sed "s|$OUT/||; s/^/  /"
fi | tee -a "$OUT/determinism_summary.txt"
[ -s "$OUT/determinism_summary.txt" ] || rm -f "$OUT/determinism_summary.txt"
if [ -s "$OUT/determinism_D1.log" ]; then  # the device returns 8 files: none without a save to rate
  $PY benchmarks/experiments/save_rate.py "$OUT/determinism_floor.txt" "$OUT/determinism_D1.log" "$OUT/determinism_DR.log" \
    | tee "$OUT/determinism_save_rate.txt"
fi
rm -rf "$DISK"
# The raw samples, traces, loss logs and the last run's whole log in one file: the device returns 8 files at most.
rm -rf "$OUT"/raw/profile_*  # tens of MB each with CUDA's events; determinism_profile_*.txt keeps their reading
mkdir -p "$OUT/raw"; mv "$OUT"/*.jsonl "$OUT/raw/" 2>/dev/null; mv "$OUT/.run.log" "$OUT/raw/last_run.log" 2>/dev/null
if [ "$(find "$OUT" -maxdepth 1 -type f | wc -l)" -gt 7 ]; then  # many runs: their logs go with the raw files too
  mv "$OUT"/determinism_*.log "$OUT/raw/"
fi
tar czf "$OUT/raw.tgz" -C "$OUT" raw && rm -rf "$OUT/raw"
echo "all done at $(( SECONDS - T0 )) s"
