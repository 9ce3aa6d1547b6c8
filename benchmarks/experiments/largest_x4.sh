#!/usr/bin/env bash
# The largest dense Llama on one node of four H200s (issue 27 item 1), in the layout the planner recommends.
#   PART=b100  101.9 B: 76 layers, hidden 10240, FFN 35840, 80 heads, 8 KV groups; bf16 moments, 16-bit remainders
#   PART=b115  115.2 B: b100's layer shape with 86 layers; fp8 moments (issue 39: the largest on four H200s)
#   PART=l70   70.7 B: 82 layers, hidden 8192, FFN 28672, 64 heads, 8 KV groups; fp32 moments, remainders
#              (the state lossless; both reduce gradients in bf16: fp32 ones leave too little HBM for the gpu tier)
#   PART=l60   60.4 B: 70 layers, hidden 8192, FFN 28672, 64 heads, 8 KV groups; fp8 moments, TP2 x PP2 only,
#              the planner's pick for global batch 64 (issue 39: MFU at global batch 64)
# MOMENTS=fp8|bf16|fp32 sets every part's moments (default: each part's own, above).
# Both: seq 2048, vocab 32000, gpu,host,nvme, gpu tier auto, host per rank as the planner suggests (80% of this
# node's memory over 4 ranks, less gradient scratch: 99 GiB of 503) unless HOST_GB is given.
# First tools/plan_offload.py --recommend --layouts auto (l60: 2x2) at the part's global batch (8; l60: 64) on this node (its disk's free space,
# and its rates as the planner probes them on DISK, as the engine does; NVME_RATES=READ:WRITE gives them instead:
# this kind's disk probed 1.11-2.42 GB/s reads, 1.69:1.95 its usual) picks TP x PP, recompute, micro-batch and gpu tier;
# its plan of that choice at GB 8 and 64 is printed (where every byte lives), then the training runs it:
# ITERS8 (default 3) iterations at GB 8 and, if ITERS64 > 0, a second launch at GB 64. Each launch under
# `timeout LIMIT` (default 420 s): start-up (pinning ~400 GiB, the state's first write to disk) takes minutes.
# Run: PART="b100 l70" bash benchmarks/run_gpu.sh largest_x4  (device tool, kind nvidia-h200-x4, carry [".whl"]);
#      DRY_RUN=1 runs tiny shapes on CPU (4 processes). PLAN_EXTRA: more planner flags (e.g. elsewhere, the x4 node's
#      "--host-memory-gb 503 --offload-nvme-capacity-gb 200"; ITERS8=0 then plans only). FLAGS_EXTRA: more training
#      flags, planned and run (e.g. "--offload-gpu-margin-gb 8").
set -u -o pipefail  # a planner that chose nothing stops its part
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 PYTHONPATH=${PYTHONPATH:-$PWD}
PY=${PYTHON:-python3}
DISK=${DISK:-/var/tmp/offload_x4}
moments_flags() { [ "$1" = fp32 ] || echo "--use-precision-aware-optimizer --exp-avg-dtype $1 --exp-avg-sq-dtype $1"; }
if [ "${DRY_RUN:-0}" = 1 ]; then
  SHAPE_b100="--num-layers 4 --hidden-size 64 --ffn-hidden-size 224 --num-attention-heads 4 --num-query-groups 2"
  SHAPE_l70="--num-layers 4 --hidden-size 64 --ffn-hidden-size 160 --num-attention-heads 4 --num-query-groups 2"
  SHAPE_b115="--num-layers 6 --hidden-size 64 --ffn-hidden-size 224 --num-attention-heads 4 --num-query-groups 2"
  SHAPE_l60="--num-layers 4 --hidden-size 64 --ffn-hidden-size 128 --num-attention-heads 4 --num-query-groups 2"
  SEQ=64; DEVICE="--device cpu"; TIERS="host,nvme"; HOST_GB=0.0005; SUB=20000; LIMIT=${LIMIT:-300}
  rates=${NVME_RATES-1:1}  # NVME_RATES= (empty): the planner probes DISK, as on the GPU machine
  MACHINE="--gpu-memory-gb 8 --host-memory-gb 16 --adam-gelems 1 --convert-gelems 1 ${rates:+--offload-bandwidths nvme=$rates}"
else
  SHAPE_b100="--num-layers 76 --hidden-size 10240 --ffn-hidden-size 35840 --num-attention-heads 80 --num-query-groups 8"
  SHAPE_l70="--num-layers 82 --hidden-size 8192 --ffn-hidden-size 28672 --num-attention-heads 64 --num-query-groups 8"
  SHAPE_b115="--num-layers 86 --hidden-size 10240 --ffn-hidden-size 35840 --num-attention-heads 80 --num-query-groups 8"
  SHAPE_l60="--num-layers 70 --hidden-size 8192 --ffn-hidden-size 28672 --num-attention-heads 64 --num-query-groups 8"
  SEQ=2048; DEVICE="--device cuda"; TIERS="gpu,host,nvme --offload-gpu-cache-gb auto"; HOST_GB=${HOST_GB:-}
  SUB=100000000; LIMIT=${LIMIT:-420}
  # 139 GiB usable of an H200; compute at the TFLOP/s the 60.4 B TP2 x PP2 run reached (its FLOPs over its 5.90 s
  # of compute alone). The disk's rates from the planner's own probe of DISK: a fixed figure (1.69:1.95, probed on
  # 2026-11-26) planned 70.7 B at 34.7 s where that call's disk, at 0.66x of it, ran 42.9 s (docs/benchmarks.md §21)
  MACHINE="--gpu-memory-gb 139 --gpu-tflops ${TFLOPS:-287} ${NVME_RATES:+--offload-bandwidths nvme=$NVME_RATES}"
fi
source benchmarks/experiments/memory_watch.sh
source benchmarks/experiments/iteration_lines.sh
for part in ${PART:-b100 l70}; do
  case $part in
    b100) SHAPE=${SHAPE_b100}; moments=bf16; layouts=auto; plan_gb=8;;
    b115) SHAPE=${SHAPE_b115}; moments=fp8; layouts=auto; plan_gb=8;;
    l70) SHAPE=${SHAPE_l70}; moments=fp32; layouts=auto; plan_gb=8;;
    l60) SHAPE=${SHAPE_l60}; moments=fp8; layouts=2x2; plan_gb=64;;
    *) echo "PART $part: expected b100, b115, l70 or l60"; continue;;
  esac
  PREC=$(moments_flags "${MOMENTS:-$moments}")
  rm -rf "$DISK"; mkdir -p "$DISK"
  FLAGS="$SHAPE --seq-length $SEQ --max-position-embeddings $SEQ --group-query-attention --swiglu
    --normalization RMSNorm --position-embedding-type rope --untie-embeddings-and-output-weights --disable-bias-linear
    --hidden-dropout 0 --attention-dropout 0 --vocab-size 32000 --micro-batch-size 1 --global-batch-size $plan_gb
    --tensor-model-parallel-size 2 --pipeline-model-parallel-size 2 --lr 3e-4 --adam-beta2 0.95 --weight-decay 0.1
    --clip-grad 1.0 --bf16 --grad-reduce-in-bf16 --mock-data --seed 1234 --log-interval 1 --log-throughput
    --recompute-granularity full --recompute-method uniform --recompute-num-layers 1 $DEVICE $PREC
    --offload-tiers $TIERS ${HOST_GB:+--offload-host-cache-gb $HOST_GB} --offload-nvme-path $DISK --offload-subgroup-size $SUB
    --offload-io-threads 8 ${FLAGS_EXTRA:-}"
  echo "== $part: the planner (global batch $plan_gb, layouts $layouts of 4 GPUs, ${MOMENTS:-$moments} moments)"
  df -h "$DISK" | tail -1
  $PY tools/plan_offload.py --gpus-per-node 4 $MACHINE ${PLAN_EXTRA:-} --recommend --layouts $layouts --json $FLAGS \
    > "$OUT/.plan.json" 2> "$OUT/.plan.err"
  $PY benchmarks/experiments/planner_choice.py "$OUT/.plan.json" "$OUT/.chosen" | tee "$OUT/${part}_plan.txt" \
    || { head -c 600 "$OUT/.plan.err"; continue; }
  mapfile -t CHOSEN < "$OUT/.chosen"
  # The chosen flags' plan at both batch sizes: where every byte lives, the iteration predicted (at the TFLOP/s
  # the planner gave the chosen recompute: --gpu-tflops is the full-recompute figure)
  $PY tools/plan_offload.py --gpus-per-node 4 $MACHINE ${PLAN_EXTRA:-} --gpu-tflops "$(cat "$OUT/.chosen.tflops")" \
    --global-batch-sizes 8,64 "${CHOSEN[@]}" \
    --global-batch-size $plan_gb 2>&1 | grep -v "^flags:" | cut -c1-700 | tee -a "$OUT/${part}_plan.txt"
  for gb in 8 64; do
    iters=$([ $gb = 8 ] && echo ${ITERS8:-3} || echo ${ITERS64:-0})
    [ "$iters" -gt 0 ] || continue
    echo "== $part global batch $gb, $iters iterations"
    rm -rf "$DISK"/*
    watch_memory "$part gb$gb" "$OUT/${part}_gb${gb}_peaks.txt" "$DISK"
    timeout $LIMIT torchrun --nproc_per_node 4 --master_port ${PORT:-29531} pretrain_gpt.py "${CHOSEN[@]}" \
      --global-batch-size $gb --train-iters $iters > "$OUT/.run.log" 2>&1
    echo "$part gb$gb exit $?"
    rm -f "$OUT/.watch"; sleep 2
    grep -v -i warn "$OUT/.run.log" | grep -E "model parameters|offload rank 0|gpu tier auto|start-up \(s\)|pinned|iteration +[0-9]|rror|Killed|refus" \
      | cut -c1-1600 > "$OUT/${part}_gb$gb.log"
    grep -E "start-up \(s\)" "$OUT/${part}_gb$gb.log" | head -1
    iteration_lines "$OUT/${part}_gb$gb.log"
    grep -E "rror|Killed|refus" "$OUT/${part}_gb$gb.log" | head -3
    cat "$OUT/${part}_gb${gb}_peaks.txt" 2>/dev/null; echo
    echo "disk after the run: $(df -h "$DISK" | tail -1)"
  done
  rm -rf "$DISK" "$OUT/.run.log" "$OUT/.plan.json" "$OUT/.plan.err" "$OUT/.chosen" "$OUT/.chosen.tflops"
done
