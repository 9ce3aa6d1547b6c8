#!/usr/bin/env bash
# The largest Llama shape trained on one H200 machine (139 GiB HBM, 128 GiB RAM, ~64 GiB disk).
# Default: 20.68 B params (52 layers, hidden 6144, FFN 16384, 48 heads, 8 KV groups, seq 2048),
# bf16 moments with 16-bit master remainders (6 B/param: 124 GB of optimizer state), the state over
# gpu (auto), pinned host and the disk; bf16 grads (--grad-reduce-in-bf16: fp32 grads would take 83
# of the 139 GB on their own). Prints where every byte lives (start-up and auto lines), iteration
# times, the prediction beside them, host and GPU peaks.
#   ITERS=4 LIMIT_S=420 bash benchmarks/run_gpu.sh largest_model     (device tool, kind nvidia-h200)
#   LAYERS=.. HIDDEN=.. FFN=.. HEADS=.. HOST_GB=.. PREC="..." GB=.. override the shape, state and global batch (1)
#   DRY_RUN=1 bash benchmarks/experiments/largest_model.sh          (tiny shape on the CPU)
set -u
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 PYTHONPATH=${PYTHONPATH:-$PWD}
DISK=${DISK:-/var/tmp/offload_big}; rm -rf "$DISK"; mkdir -p "$DISK"
PREC=${PREC:---use-precision-aware-optimizer --exp-avg-dtype bf16 --exp-avg-sq-dtype bf16}
if [ "${DRY_RUN:-0}" = 1 ]; then
  SHAPE="--num-layers 2 --hidden-size 128 --ffn-hidden-size 256 --num-attention-heads 8 --num-query-groups 2
    --seq-length 64 --max-position-embeddings 64"
  DEVICE="--device cpu"; TIERS="host,nvme --offload-host-cache-gb 0.0005"; SUB=20000
else
  SHAPE="--num-layers ${LAYERS:-52} --hidden-size ${HIDDEN:-6144} --ffn-hidden-size ${FFN:-16384}
    --num-attention-heads ${HEADS:-48} --num-query-groups 8 --seq-length 2048 --max-position-embeddings 2048"
  DEVICE="--device cuda"; TIERS="gpu,host,nvme --offload-gpu-cache-gb auto --offload-host-cache-gb ${HOST_GB:-84}"
  SUB=100000000
fi
free -g | head -2; df -h "$DISK" | tail -1
source benchmarks/experiments/memory_watch.sh
watch_memory "largest" "$OUT/largest_peaks.txt"
sleep 1
source benchmarks/experiments/timestamps.sh  # since_launch: each line prefixed by the seconds since launch
timeout ${LIMIT_S:-420} torchrun --nproc_per_node 1 --master_port ${PORT:-29517} pretrain_gpt.py $SHAPE \
  --group-query-attention --swiglu --normalization RMSNorm --position-embedding-type rope \
  --untie-embeddings-and-output-weights --disable-bias-linear --hidden-dropout 0 --attention-dropout 0 \
  --vocab-size 32000 --micro-batch-size 1 --global-batch-size ${GB:-1} --train-iters ${ITERS:-4} --lr 3e-4 \
  --adam-beta2 0.95 --weight-decay 0.1 --clip-grad 1.0 --bf16 --grad-reduce-in-bf16 --mock-data --seed 1234 \
  --recompute-granularity full --recompute-method uniform --recompute-num-layers 1 $DEVICE --log-interval 1 \
  $PREC --offload-tiers $TIERS --offload-nvme-path "$DISK" --offload-subgroup-size $SUB --offload-io-threads 8 \
  --offload-telemetry-log "$OUT/largest_telemetry.jsonl" ${EXTRA:-} 2>&1 | since_launch > "$OUT/.largest.log"
echo "exit ${PIPESTATUS[0]}"
rm -f "$OUT/.watch"; sleep 2
grep -v -i warn "$OUT/.largest.log" | grep -E "model parameters|offload rank|gpu tier auto|host memory|pinned|start-up|predicted|iteration |rror|Killed|refus|overlap|> params|> layer-major" \
  | cut -c1-1000 | tee "$OUT/largest.log"
[ -n "${NCCL_DEBUG:-}" ] && grep -E "NCCL (WARN|INFO)" "$OUT/.largest.log" | grep -iE "alloc|fail|error|mem|cuda" \
  | tail -60 > "$OUT/nccl.txt"  # with NCCL_DEBUG set: NCCL's allocations and failures
cat "$OUT/largest_peaks.txt"; du -sh "$DISK" | cat; free -g | head -2
rm -rf "$DISK" "$OUT/.largest.log"
