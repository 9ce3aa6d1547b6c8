#!/usr/bin/env bash
# The update under the next forward above data-parallel size 1 (issue 26): DP4, bit for bit against megatron-core and ours in series.
# A 2.7 B Llama shape (32 layers, hidden 2560, FFN 6912, 32 heads, 8 KV groups, seq 2048) at DP4 on four GPUs,
# global batch 16 (4 micro-batches per rank), --overlap-grad-reduce --overlap-param-gather (megatron-core's per-bucket
# gather in the forward), fp32 master (--no-store-param-remainders), the state in host memory streamed through the
# GPU: megatron-core's DistributedOptimizer ("mcore"), ours in series ("serial") and with --offload-overlap-forward
# ("overlap"); losses and grad norms compared bit for bit, iteration times and the forward's wait kept.
#   bash benchmarks/run_gpu.sh overlap_dp        (device tool, kind nvidia-h200-x4, carry [".whl"])
#   DRY_RUN=1 bash benchmarks/experiments/overlap_dp.sh      (tiny shape, 4 CPU processes)
set -u
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 PYTHONPATH=${PYTHONPATH:-$PWD}
PY=${PYTHON:-python3}
if [ "${DRY_RUN:-0}" = 1 ]; then
  SHAPE="--num-layers 4 --hidden-size 64 --ffn-hidden-size 128 --num-attention-heads 4 --num-query-groups 2
    --seq-length 64 --max-position-embeddings 64"
  DEVICE="--device cpu --offload-adam-kernel single"; LIMIT=240; SUB=2000
else
  SHAPE="--num-layers 32 --hidden-size 2560 --ffn-hidden-size 6912 --num-attention-heads 32 --num-query-groups 8
    --seq-length 2048 --max-position-embeddings 2048"
  DEVICE="--device cuda"; LIMIT=${LIMIT:-150}; SUB=50000000
fi
# megatron-core's unfused attention: torch SDPA's flash backward adds into dq with atomics, so its grads differ
# run to run (a DP4 run's iteration-1 grad norms differed in the 6th digit, 2026-11-26): no bit-for-bit check with it.
EXACT_ATTENTION="--attention-backend local"
COMMON="$SHAPE $EXACT_ATTENTION --group-query-attention --swiglu --normalization RMSNorm --position-embedding-type rope
  --untie-embeddings-and-output-weights --disable-bias-linear --hidden-dropout 0 --attention-dropout 0
  --vocab-size 32000 --micro-batch-size 1 --global-batch-size 16 --train-iters ${ITERS:-8} --lr 3e-4
  --adam-beta2 0.95 --weight-decay 0.1 --clip-grad 1.0 --bf16 --mock-data --seed 1234 --log-interval 1
  --overlap-grad-reduce --overlap-param-gather --use-distributed-optimizer $DEVICE"
for kind in ${KINDS:-mcore serial overlap}; do
  case $kind in
    mcore) FLAGS="";;
    serial) FLAGS="--offload-tiers host --offload-update gpu --offload-subgroup-size $SUB --no-store-param-remainders";;
    overlap) FLAGS="--offload-tiers host --offload-update gpu --offload-subgroup-size $SUB --no-store-param-remainders
      --offload-overlap-forward";;
  esac
  timeout $LIMIT torchrun --nproc_per_node 4 --master_port ${PORT:-29531} pretrain_gpt.py $COMMON $FLAGS \
    --loss-log "$OUT/.loss_$kind.jsonl" 2>&1 | grep -v -i warn > "$OUT/.run.log"
  echo "$kind exit ${PIPESTATUS[0]}"
  grep -E "offload rank 0|overlap|iteration +[0-9]|rror|Killed|refus" "$OUT/.run.log" | cut -c1-900 >> "$OUT/overlap_dp.log"
  grep -E "iteration +[0-9]" "$OUT/.run.log" | grep -o "iteration *[0-9]*/\|elapsed time per iteration (ms): [0-9.]*\|offload update time (ms): [0-9.]*\|offload device update time (ms): [0-9.]*\|offload forward wait (ms): [0-9.]*\|offload predicted iteration time (ms): [0-9.]*" | paste -sd' ' | sed 's/iteration /\n&/g' | tail -n +2
  echo
done
$PY - "$OUT" <<'PY' | tee "$OUT/overlap_dp_losses.txt"
import json, sys, pathlib
out = pathlib.Path(sys.argv[1])
def load(kind):
    path = out / f".loss_{kind}.jsonl"
    return {r["iteration"]: (r["loss"], r.get("grad_norm")) for r in map(json.loads, path.read_text().splitlines())} if path.exists() else {}
runs = {k: load(k) for k in ("mcore", "serial", "overlap")}
for it in sorted(runs["mcore"]):
    print(it, "  ".join(f"{k} {runs[k].get(it)!r}" for k in runs))
for k in ("serial", "overlap"):
    same = runs[k] and runs[k] == runs["mcore"]
    print(f"{'PASS' if same else 'FAIL'} {k}: {'bit-identical' if same else 'different'} to mcore ({len(runs[k])} iterations)")
PY
rm -f "$OUT"/.loss_*.jsonl "$OUT/.run.log"
