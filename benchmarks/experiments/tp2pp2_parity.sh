#!/usr/bin/env bash
# TP2 x PP2 on four GPUs (nvidia-h200-x4): the 13.0 B Llama-2 shape (40 layers, hidden 5120, FFN 13824, 40 heads,
# MHA), 8 micro-batches, 5 iterations: megatron-core's DistributedOptimizer, ours with the whole state in the gpu
# tier and ours with host state streamed through the GPU (both --no-store-param-remainders, one-pass kernels on);
# losses compared bit for bit, iteration times and the engine's start-up line (which kernel ran) kept.
#   bash benchmarks/run_gpu.sh tp2pp2_parity        (device tool, kind nvidia-h200-x4, carry [".whl"])
#   DRY_RUN=1 bash benchmarks/experiments/tp2pp2_parity.sh      (tiny shape, 4 CPU processes)
set -u
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 PYTHONPATH=${PYTHONPATH:-$PWD}
PY=${PYTHON:-python3}
if [ "${DRY_RUN:-0}" = 1 ]; then
  SHAPE="--num-layers 4 --hidden-size 64 --ffn-hidden-size 128 --num-attention-heads 4 --seq-length 64 --max-position-embeddings 64"
  DEVICE="--device cpu"; GPU_GB=0.01; LIMIT=240; SUB=20000
else
  SHAPE="--num-layers 40 --hidden-size 5120 --ffn-hidden-size 13824 --num-attention-heads 40 --seq-length 2048 --max-position-embeddings 2048"
  DEVICE="--device cuda"; GPU_GB=${GPU_GB:-44}; LIMIT=${LIMIT:-170}; SUB=100000000
fi
COMMON="$SHAPE --swiglu --normalization RMSNorm --position-embedding-type rope --untie-embeddings-and-output-weights
  --disable-bias-linear --hidden-dropout 0 --attention-dropout 0 --vocab-size 32000 --micro-batch-size 1
  --global-batch-size 8 --tensor-model-parallel-size 2 --pipeline-model-parallel-size 2 --train-iters ${ITERS:-5}
  --lr 3e-4 --adam-beta2 0.95 --weight-decay 0.1 --clip-grad 1.0 --bf16 --mock-data --seed 1234 --log-interval 1
  --recompute-granularity full --recompute-method uniform --recompute-num-layers 1 $DEVICE"
for kind in ${KINDS:-mcore gpu stream}; do
  case $kind in
    mcore) FLAGS="--use-distributed-optimizer";;
    gpu) FLAGS="--offload-tiers gpu,host --offload-gpu-cache-gb $GPU_GB --offload-update cpu --no-store-param-remainders";;
    stream) FLAGS="--offload-tiers host --offload-update gpu --offload-subgroup-size $SUB --no-store-param-remainders";;
  esac
  timeout $LIMIT torchrun --nproc_per_node 4 --master_port ${PORT:-29521} pretrain_gpt.py $COMMON $FLAGS \
    --loss-log "$OUT/.loss_$kind.jsonl" > "$OUT/.run.log" 2>&1
  echo "$kind exit $?"
  grep -v -i warn "$OUT/.run.log" | grep -E "offload rank 0|iteration +[0-9]|rror|Killed" | cut -c1-600 | tee -a "$OUT/tp2pp2.log" | grep -E "iteration +[0-9]" | cut -c1-140
done
$PY - "$OUT" <<'PY' | tee "$OUT/tp2pp2_losses.txt"
import json, sys, pathlib
out = pathlib.Path(sys.argv[1])
runs = {k: {r["iteration"]: r["loss"] for r in map(json.loads, (out / f".loss_{k}.jsonl").read_text().splitlines())}
        if (out / f".loss_{k}.jsonl").exists() else {} for k in ("mcore", "gpu", "stream")}
for it in sorted(runs["mcore"]):
    print(it, "  ".join(f"{k} {runs[k].get(it)!r}" for k in runs))
for k in ("gpu", "stream"):
    print(f"{k}: {'BIT-IDENTICAL' if runs[k] and runs[k] == runs['mcore'] else 'DIFFERENT'} to mcore ({len(runs[k])} iterations)")
PY
rm -f "$OUT"/.loss_*.jsonl "$OUT/.run.log"
