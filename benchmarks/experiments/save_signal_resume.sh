#!/usr/bin/env bash
# One device call: the trust features on a GPU. 1.03 B Llama shape, host (4 GB) + disk tiers.
#  U: 6 iterations uninterrupted, saving at 3 and 6: save time and rate of the offloaded state.
#  S: the same with --exit-signal-handler --exit-signal SIGUSR1; SIGUSR1 to the ranks after
#     iteration 2: they must finish the iteration, save a complete checkpoint and exit 0.
#  R: the same command again: resumes from S's checkpoint; S's and R's losses must equal U's.
# Needs megatron-core (and psutil) wheels in .whl/: device tool carry [".whl"].
set -u
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
export PYTHONWARNINGS=ignore
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader; nproc; free -g | head -2
DISK=${DISK:-/var/tmp/trust}; rm -rf "$DISK"; mkdir -p "$DISK/nvme"; df -h "$DISK" | cat
MODEL="--num-layers 20 --hidden-size 2048 --ffn-hidden-size 5632 --num-attention-heads 16 --group-query-attention --num-query-groups 4
 --vocab-size 32000 --seq-length 2048 --max-position-embeddings 2048 --swiglu --normalization RMSNorm
 --position-embedding-type rope --untie-embeddings-and-output-weights --disable-bias-linear
 --hidden-dropout 0 --attention-dropout 0 --micro-batch-size 1 --global-batch-size 4 --train-iters 6
 --lr 3e-4 --min-lr 3e-5 --lr-decay-style cosine --lr-warmup-iters 1 --weight-decay 0.1 --adam-beta2 0.95
 --bf16 --mock-data --device cuda --log-interval 1 --seed 1234 --recompute-granularity full"
OFFLOAD="--offload-tiers host,nvme --offload-nvme-path $DISK/nvme --offload-host-cache-gb 4 --offload-io-threads 8"
run() { torchrun --nproc_per_node 1 pretrain_gpt.py $MODEL $OFFLOAD "$@"; }
T0=$SECONDS
run --loss-log "$OUT/U.jsonl" --save "$DISK/ckptU" --save-interval 3 2>&1 | grep -v Warn > "$OUT/U.log"
grep -E "saved checkpoint|iteration +[0-9]+/|error" "$OUT/U.log" | cut -c1-260
du -sh "$DISK"/ckptU/iter_*/offload "$DISK"/ckptU/iter_* | cat; rm -rf "$DISK/ckptU"
echo "U done at $(( SECONDS - T0 )) s"
CK="--save $DISK/ckpt --load $DISK/ckpt --exit-signal-handler --exit-signal SIGUSR1"
# SIGUSR1 to the ranks alone (as a batch script's trap would forward SLURM's warning): torchrun
# (< 2.12) would SIGKILL its workers 30 s after a SIGTERM, too early for a 12 GB save on this disk.
setsid torchrun --nproc_per_node 1 pretrain_gpt.py $MODEL $OFFLOAD $CK --loss-log "$OUT/S.jsonl" > "$OUT/S.log" 2>&1 &
PID=$!
for _ in $(seq 600); do [ -f "$OUT/S.jsonl" ] && [ "$(wc -l < "$OUT/S.jsonl")" -ge 2 ] && break; sleep 0.5; done
echo "SIGUSR1 to the ranks after $(wc -l < "$OUT/S.jsonl") iterations at $(( SECONDS - T0 )) s"
pkill -USR1 -P $PID; wait $PID; echo "torchrun exit status $?"
grep -v Warn "$OUT/S.log" | grep -E "SIGUSR1|SIGTERM|exiting|saved checkpoint|error|rank 0\]" | cut -c1-260
ls "$DISK"/ckpt "$DISK"/ckpt/iter_* | cat; cat "$DISK/ckpt/latest_checkpointed_iteration.txt"; echo
echo "nvme namespaces left: $(find "$DISK/nvme" -name 'rank*' | wc -l)"
run $CK --loss-log "$OUT/R.jsonl" 2>&1 | grep -v Warn > "$OUT/R.log"
grep -E "loaded|resuming|saved checkpoint|iteration +[0-9]+/|error" "$OUT/R.log" | cut -c1-200
python3 - "$OUT" <<'PY'
import json, sys
out = sys.argv[1]
load = lambda n: [json.loads(l) for l in open(f"{out}/{n}.jsonl")]
u, s, r = load("U"), load("S"), load("R")
print("signalled run saved after iteration", len(s), "| resumed iterations", [x["iteration"] for x in r])
print("S + R identical to U:", s + r == u)
for a, b in zip(u, s + r):
    print(f"  iter {a['iteration']}: U {a['loss']:.6f}  S/R {b['loss']:.6f}  {'==' if a == b else '!='}")
PY
rm -rf "$DISK"
echo "gpu_trust.sh: $(( SECONDS - T0 )) s"
