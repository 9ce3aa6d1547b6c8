#!/usr/bin/env bash
# One device call (one GPU): --async-save with the offloaded state written in the background.
# 1.03 B Llama shape, host (4 GB) + disk tiers, 6 iterations, a save at 4:
#  S: synchronous save; A: --async-save; R: resumes A's checkpoint (iterations 5..6). CASES=A: S skipped.
# Prints how long each save held training, the iteration times around it, and whether A's and R's
# losses equal S's. Needs megatron-core (and psutil) wheels in .whl/: device tool carry [".whl"].
set -u
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
export PYTHONWARNINGS=ignore
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader; nproc; free -g | head -2
DISK=${DISK:-/var/tmp/async}; rm -rf "$DISK"; mkdir -p "$DISK/nvme"; df -h "$DISK" | cat
MODEL="--num-layers 20 --hidden-size 2048 --ffn-hidden-size 5632 --num-attention-heads 16 --group-query-attention --num-query-groups 4
 --vocab-size 32000 --seq-length 2048 --max-position-embeddings 2048 --swiglu --normalization RMSNorm
 --position-embedding-type rope --untie-embeddings-and-output-weights --disable-bias-linear
 --hidden-dropout 0 --attention-dropout 0 --micro-batch-size 1 --global-batch-size 4 --train-iters 6
 --lr 3e-4 --min-lr 3e-5 --lr-decay-style cosine --lr-warmup-iters 1 --weight-decay 0.1 --adam-beta2 0.95
 --bf16 --mock-data --device cuda --log-interval 1 --seed 1234 --recompute-granularity full --save-interval 4"
OFFLOAD="--offload-tiers host,nvme --offload-nvme-path $DISK/nvme --offload-host-cache-gb 4 --offload-io-threads 8"
run() { torchrun --nproc_per_node 1 pretrain_gpt.py $MODEL $OFFLOAD "$@"; }
T0=$SECONDS
for case in ${CASES:-S A}; do
  extra=""; [ $case = A ] && extra="--async-save"
  run --save "$DISK/ckpt$case" --loss-log "$OUT/$case.jsonl" $extra > "$OUT/$case.log" 2>&1; echo "$case exit $?"
  grep -E "checkpoint|iteration +[0-9]+/|^error|held|paused" "$OUT/$case.log" | cut -c1-330
  echo "$case done at $(( SECONDS - T0 )) s"
  [ $case = S ] && rm -rf "$DISK/ckptS"  # the disk holds about four 14 GB checkpoints with the swap files
done
mkdir -p $DISK/ckptR && cp -r $DISK/ckptA/iter_0000004 $DISK/ckptR/ && echo 4 > $DISK/ckptR/latest_checkpointed_iteration.txt
ls $DISK/ckptR/iter_0000004 | head; rm -rf $DISK/ckptA
run --load "$DISK/ckptR" --save "$DISK/ckptR" --loss-log "$OUT/R.jsonl" > "$OUT/R.log" 2>&1; echo "R exit $?"
grep -E "loaded|iteration +[0-9]+/|^error" "$OUT/R.log" | cut -c1-200
python3 - "$OUT" <<'PY'
import json, os, sys
out = sys.argv[1]
load = lambda n: {r["iteration"]: r["loss"] for r in map(json.loads, open(f"{out}/{n}.jsonl"))} if os.path.exists(f"{out}/{n}.jsonl") else {}
s, a, r = load("S"), load("A"), load("R")
for it in sorted(a):
    print(f"iter {it} sync {s.get(it, float('nan')):.6f} async {a[it]:.6f} resumed-from-async {r.get(it, float('nan')):.6f}"
          f"  async==sync {a[it] == s.get(it) if s else '-'}  resumed==async {r.get(it) == a[it] if it in r else '-'}")
PY
echo "all done at $(( SECONDS - T0 )) s"
