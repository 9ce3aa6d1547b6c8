#!/usr/bin/env bash
# The update under the next forward (--offload-overlap-forward, issue 26): where the host waits, and iteration times.
#   PART=queue   launch_queue.py: how many launches CUDA queues before the host blocks
#   PART=20b     the 20.68 B README command (largest_model.sh), VARIANTS="overlap serial" (with/without the flag)
#   PART=peers3b 3.0 B host only: ours (with --offload-overlap-forward) against megatron-core's CPU offload and
#                the same model without offload (compute and update on the GPU, the state in HBM), one call
#   PART=peers3b_ra  ours alone as in peers3b, with --offload-read-ahead-gb RA3B (default 8)
#   PART=60b     60.4 B Llama on four GPUs (kind nvidia-h200-x4), TP2 x PP2, bf16 moments, gpu,host,nvme auto,
#                host 60 GiB per rank, global batch GB60 (default 8); VARIANTS60 (default "overlap")
# Run: PART=... bash benchmarks/run_gpu.sh overlap   (device tool, carry [".whl"]); DRY_RUN=1 runs tiny shapes on CPU.
set -u
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 PYTHONPATH=${PYTHONPATH:-$PWD}
PY=${PYTHON:-python3}
flag_of() { [ "$1" = overlap ] && echo "--offload-overlap-forward" || echo ""; }
for part in ${PART:-queue}; do
  case $part in
    queue)
      [ "${DRY_RUN:-0}" = 1 ] && { echo "queue: needs CUDA"; continue; }
      $PY benchmarks/experiments/launch_queue.py 4000 2>&1 | tee "$OUT/launch_queue.txt";;
    20b)
      for variant in ${VARIANTS:-overlap serial}; do
        echo "== 20b $variant"
        EXTRA="$(flag_of $variant) ${EXTRA20B:-}" ITERS=${ITERS:-8} bash benchmarks/experiments/largest_model.sh
        mv "$OUT/largest.log" "$OUT/20b_$variant.log"; mv "$OUT/largest_peaks.txt" "$OUT/20b_${variant}_peaks.txt"
        mv "$OUT/largest_telemetry.jsonl" "$OUT/20b_${variant}_telemetry.jsonl" 2>/dev/null
      done;;
    peers3b)
      SHAPE3B=${SHAPE3B:---layers 28 --hidden 3072 --ffn 8192 --heads 24 --kv-heads 8}; OURS3B=${OURS3B:-}
      DEV=""; [ "${DRY_RUN:-0}" = 1 ] && { SHAPE3B="--layers 2 --hidden 64 --ffn 128 --heads 4 --kv-heads 2 --seq 64"; DEV="--device cpu"; }
      $PY benchmarks/peers.py --systems ${SYSTEMS3B:-afg} $SHAPE3B --micro-batch 1 --host-budget-gb 5.96 \
        --iters ${ITERS3B:-5} --disk-dir /var/tmp/offload_cmp --shm-dir /dev/shm/offload_cmp --out "$OUT" \
        --budget-s ${BUDGET3B:-400} --ours-flags="--offload-overlap-forward $OURS3B" $DEV 2>&1 | grep -v -i warn | tail -25 \
        | tee "$OUT/peers3b_overlap.txt"
      rm -rf /var/tmp/offload_cmp /dev/shm/offload_cmp "$OUT"/logs.tar.gz;;
    peers3b_ra)  # ours alone with the host state read ahead (RA3B GiB of GPU memory) under the compute before each step
      OUT="$OUT/read_ahead" PART=peers3b SYSTEMS3B=a OURS3B="--offload-read-ahead-gb ${RA3B:-8}" bash "$0";;
    60b)
      DISK=${DISK:-/var/tmp/offload_60b}; rm -rf "$DISK"; mkdir -p "$DISK"
      if [ "${DRY_RUN:-0}" = 1 ]; then
        SHAPE="--num-layers 4 --hidden-size 64 --ffn-hidden-size 128 --num-attention-heads 4 --num-query-groups 2
          --seq-length 64 --max-position-embeddings 64"
        DEVICE="--device cpu"; TIERS="host,nvme --offload-host-cache-gb 0.0005"; SUB=20000; LIMIT=300
      else
        SHAPE="--num-layers 70 --hidden-size 8192 --ffn-hidden-size 28672 --num-attention-heads 64 --num-query-groups 8
          --seq-length 2048 --max-position-embeddings 2048"
        DEVICE="--device cuda"; TIERS="gpu,host,nvme --offload-gpu-cache-gb auto --offload-host-cache-gb ${HOST_GB:-60}"
        SUB=100000000; LIMIT=${LIMIT:-560}
      fi
      for variant in ${VARIANTS60:-overlap}; do
        echo "== 60b $variant"
        source benchmarks/experiments/memory_watch.sh
        source benchmarks/experiments/timestamps.sh
        watch_memory "60b" "$OUT/60b_${variant}_peaks.txt"
        timeout $LIMIT torchrun --nproc_per_node 4 --master_port ${PORT:-29523} pretrain_gpt.py $SHAPE \
          --group-query-attention --swiglu --normalization RMSNorm --position-embedding-type rope \
          --untie-embeddings-and-output-weights --disable-bias-linear --hidden-dropout 0 --attention-dropout 0 \
          --vocab-size 32000 --micro-batch-size 1 --global-batch-size ${GB60:-8} --tensor-model-parallel-size 2 \
          --pipeline-model-parallel-size 2 --train-iters ${ITERS60:-7} --lr 3e-4 --adam-beta2 0.95 --weight-decay 0.1 \
          --clip-grad 1.0 --bf16 --grad-reduce-in-bf16 --mock-data --seed 1234 --log-interval 1 \
          --recompute-granularity full --recompute-method uniform --recompute-num-layers 1 $DEVICE \
          --use-precision-aware-optimizer --exp-avg-dtype bf16 --exp-avg-sq-dtype bf16 \
          --offload-tiers $TIERS --offload-nvme-path "$DISK" --offload-subgroup-size $SUB --offload-io-threads 8 \
          $(flag_of $variant) 2>&1 | since_launch > "$OUT/.60b.log"
        echo "60b $variant exit ${PIPESTATUS[0]}"
        rm -f "$OUT/.watch"; sleep 2
        grep -v -i warn "$OUT/.60b.log" | grep -E "model parameters|offload rank|gpu tier auto|host memory|pinned|start-up|kernel ready|predicted|iteration +[0-9]|rror|Killed|refus|overlap" \
          | cut -c1-1200 > "$OUT/60b_$variant.log"
        grep -E "iteration +[0-9]" "$OUT/60b_$variant.log" | grep -o "iteration *[0-9]*/\|elapsed time per iteration (ms): [0-9.]*\|offload update time (ms): [0-9.]*\|offload predicted iteration time (ms): [0-9.]*\|offload forward wait (ms): [0-9.]*\|offload device update time (ms): [0-9.]*" | paste -sd' ' | sed 's/iteration /\n&/g'
        cat "$OUT/60b_${variant}_peaks.txt" 2>/dev/null
        rm -f "$OUT/.60b.log"
      done
      rm -rf "$DISK";;
  esac
done
