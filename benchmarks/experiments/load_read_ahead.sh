#!/usr/bin/env bash
# A load with the page cache dropped, the torch_dist files read ahead (the default) and not (--no-ckpt-read-ahead),
# ROUNDS times each, alternating; the load's line of each. A save at 2 first. One process, on the CPU:
#   bash benchmarks/experiments/load_read_ahead.sh           (as root: drop_caches; about 4 minutes on 2 cores)
#   BASELINE=/path/to/other/checkout bash ...                 its load (read-ahead on) in turn with this one's, instead
# 0.31 B Llama: 4 layers, hidden 2048, FFN 5632, vocab 32000, fp8 moments, gpu,host,nvme tiers of 0.3 GiB.
set -u
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 PYTHONWARNINGS=ignore PYTHONPATH=${PYTHONPATH:-$PWD}
DISK=${DISK:-/var/tmp/load_read_ahead}; rm -rf "$DISK"; mkdir -p "$DISK/nvme"
PY=${PYTHON:-python3}
COMMON="--num-layers 4 --hidden-size 2048 --ffn-hidden-size 5632 --num-attention-heads 16 --num-query-groups 4
  --seq-length 128 --max-position-embeddings 128 --device cpu --group-query-attention --swiglu --normalization RMSNorm
  --position-embedding-type rope --untie-embeddings-and-output-weights --disable-bias-linear --vocab-size 32000
  --micro-batch-size 1 --global-batch-size 1 --train-iters 2 --lr 3e-4 --bf16 --mock-data --seed 1234 --log-interval 1
  --use-precision-aware-optimizer --exp-avg-dtype fp8 --exp-avg-sq-dtype fp8 --offload-tiers gpu,host,nvme
  --offload-gpu-cache-gb 0.3 --offload-host-cache-gb 0.3 --offload-nvme-path $DISK/nvme --offload-subgroup-size 20000000"
run() {  # NAME [flags]
  local name=$1; shift
  # shellcheck disable=SC2086
  timeout "${RUN_LIMIT:-600}" torchrun --nproc_per_node 1 --master_port "${PORT:-29571}" pretrain_gpt.py $COMMON "$@" \
    > "$OUT/load_read_ahead_$name.log" 2>&1
  echo "$name exit $?: $(grep -E '^> (saved checkpoint|checkpoint read)' "$OUT/load_read_ahead_$name.log" | cut -c1-1200)"
}
run save --save "$DISK/ckpt" --save-interval 2
du -sh "$DISK/ckpt/iter_0000002" | cat
for round in $(seq "${ROUNDS:-3}"); do
  for mode in off on; do
    sync; echo 3 > /proc/sys/vm/drop_caches 2>/dev/null || echo "page cache NOT dropped"
    if [ -n "${BASELINE:-}" ] && [ $mode = off ]; then
      (cd "$BASELINE" && PYTHONPATH=$BASELINE OUT=$OUT run "baseline$round" --load "$DISK/ckpt")
    elif [ $mode = off ]; then run "off$round" --load "$DISK/ckpt" --no-ckpt-read-ahead; else run "on$round" --load "$DISK/ckpt"; fi
  done
done
rm -rf "$DISK"
