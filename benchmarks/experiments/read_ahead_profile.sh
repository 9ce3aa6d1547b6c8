#!/usr/bin/env bash
# Where the 3.0 B host-only overlapped iteration spends the host link, with and without --offload-read-ahead-gb:
# torch.profiler over iterations 7-8 (pretrain_gpt.py --profile), then stream_timeline.py's busy and idle figures.
#   bash benchmarks/run_gpu.sh read_ahead_profile     (device tool, one H200, carry [".whl"]); DRY_RUN=1 on CPU
set -u
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 PYTHONPATH=${PYTHONPATH:-$PWD}
if [ "${DRY_RUN:-0}" = 1 ]; then
  SHAPE="--num-layers 2 --hidden-size 64 --ffn-hidden-size 128 --num-attention-heads 4 --num-query-groups 2
    --seq-length 64 --max-position-embeddings 64"; DEVICE="--device cpu"; SUB=5000; RA=0.0002
else
  SHAPE="--num-layers 28 --hidden-size 3072 --ffn-hidden-size 8192 --num-attention-heads 24 --num-query-groups 8
    --seq-length 2048 --max-position-embeddings 2048"; DEVICE="--device cuda"; SUB=100000000; RA=${RA:-8}
fi
for kind in overlap overlap_ra; do
  FLAGS="--offload-overlap-forward"; [ $kind = overlap_ra ] && FLAGS="$FLAGS --offload-read-ahead-gb $RA"
  rm -rf "$OUT/tb_$kind"
  timeout ${LIMIT:-150} torchrun --nproc_per_node 1 --master_port ${PORT:-29545} pretrain_gpt.py $SHAPE \
    --group-query-attention --swiglu --normalization RMSNorm --position-embedding-type rope \
    --untie-embeddings-and-output-weights --disable-bias-linear --hidden-dropout 0 --attention-dropout 0 \
    --vocab-size 32000 --micro-batch-size 1 --global-batch-size 1 --train-iters 9 --lr 3e-4 --weight-decay 0.1 \
    --adam-beta2 0.95 --clip-grad 1.0 --bf16 --mock-data --seed 1234 --log-interval 1 \
    --recompute-granularity full --recompute-method uniform --recompute-num-layers 1 $DEVICE \
    --offload-tiers host --offload-subgroup-size $SUB --offload-io-threads 8 $FLAGS \
    --profile --profile-step-start 6 --profile-step-end 8 --tensorboard-dir "$OUT/tb_$kind" 2>&1 \
    | grep -v -i warn > "$OUT/profile_$kind.log"
  echo "$kind exit ${PIPESTATUS[0]}"
  grep -E "iteration +[0-9]+/" "$OUT/profile_$kind.log" | cut -c1-200 | tail -4
  grep -o "offload predicted iteration time (ms): [0-9.]*" "$OUT/profile_$kind.log" | tail -2
  trace=$(ls "$OUT"/tb_$kind/*.json 2>/dev/null | head -1)
  [ -n "$trace" ] && python3 benchmarks/experiments/stream_timeline.py "$trace" 2 | tee "$OUT/timeline_$kind.txt"
  rm -rf "$OUT/tb_$kind"
done
