#!/usr/bin/env bash
# One device call: the largest Llama shape we train on one H200 machine (128 GiB RAM, ~64 GiB disk):
# 8.8 B params, 106 GB of fp32 optimizer state: 70 GB in pinned host memory, the rest on the disk.
set -u
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
DISK=/var/tmp/offload_big; mkdir -p $DISK
free -g | head -2; df -h $DISK | cat
python3 - <<'PY'
import time, torch
from mlp_offload import HostMemory
host = HostMemory(None, pin=True)
buf = host.allocate(2 << 30, "check")
dev = torch.empty(2 << 30, dtype=torch.uint8, device="cuda")
dev.copy_(buf, non_blocking=True); torch.cuda.synchronize()
t = time.perf_counter(); dev.copy_(buf, non_blocking=True); torch.cuda.synchronize()
print(f"registered host memory: pinned={buf.is_pinned()}, H2D {2 / (time.perf_counter() - t):.1f} GiB/s")
host.close()
PY
timeout ${LIMIT_S:-420} torchrun --nproc_per_node 1 pretrain_gpt.py \
  --num-layers 48 --hidden-size 4096 --ffn-hidden-size 11008 --num-attention-heads 32 --group-query-attention --num-query-groups 8 \
  --swiglu --normalization RMSNorm --position-embedding-type rope --untie-embeddings-and-output-weights \
  --disable-bias-linear --hidden-dropout 0 --attention-dropout 0 --vocab-size 32000 \
  --seq-length 2048 --max-position-embeddings 2048 --micro-batch-size 1 --global-batch-size 1 \
  --train-iters ${ITERS:-3} --lr 3e-4 --adam-beta2 0.95 --weight-decay 0.1 --clip-grad 1.0 --bf16 --mock-data \
  --recompute-granularity full --recompute-method uniform --recompute-num-layers 1 --device cuda --log-interval 1 \
  --offload-tiers host,nvme --offload-nvme-path $DISK --offload-host-cache-gb 70 --offload-subgroup-size 100000000 \
  --offload-io-threads 8 --offload-telemetry-log $OUT/telemetry.jsonl --timing-log $OUT/timing.jsonl 2>&1 \
  | grep -v -i warn | tee $OUT/biggest.log | grep -E "model parameters|offload rank|iteration|rror|Killed" | cut -c1-700
echo "exit ${PIPESTATUS[0]}"; free -g | head -2; du -sh $DISK | cat; rm -rf $DISK
