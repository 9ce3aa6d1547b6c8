# Sourced by examples/one_gpu.sh and examples/one_node.sh (not run alone): a Llama-shaped model's flags from
# the environment, then one of three modes on the same flags:
#   (default)   train: torchrun --standalone --nproc_per_node $NPROC pretrain_gpt.py ...
#   PLAN=1      will it fit? tools/plan_offload.py with this machine's GPUs and the same flags (exit 1: does not fit)
#   DRY_RUN=1   print the command (or, with PLAN=1, the planner's) and exit; tests/unit/test_examples.py parses it
# The calling script sets NAME, NPROC, TP, PP and the shape's defaults; flags after the script name go last to
# pretrain_gpt.py (and to the planner) and win over these.
# Environment: LAYERS HIDDEN FFN HEADS KV_GROUPS SEQ (shape), MOMENTS (fp32 | bf16 | fp8: Adam's moments as stored),
#   HOST_GB (pinned host memory per rank for optimizer state), DISK (a directory on a local disk: the "nvme" tier),
#   DATA_PATH (a tools/preprocess_data.py prefix; default: mock data), TOKENIZER_ARGS (with DATA_PATH), CKPT
#   (saved every SAVE_INTERVAL iterations and resumed from), ITERS, MBS, GBS, LR.
set -euo pipefail
REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
RUN="${RUN_DIR:-$REPO/runs/$NAME}"

MOMENTS=${MOMENTS:-bf16}
case "$MOMENTS" in
    fp32) MOMENTS_FLAGS=() ;;  # lossless: fp32 moments, the fp32 master kept as 16-bit remainders
    bf16 | fp8)
        MOMENTS_FLAGS=(--use-precision-aware-optimizer --exp-avg-dtype "$MOMENTS" --exp-avg-sq-dtype "$MOMENTS") ;;
    *) echo "error: MOMENTS=${MOMENTS}: expected fp32, bf16 or fp8" >&2; exit 2 ;;
esac
if [ -n "${DATA_PATH:-}" ]; then
    read -r -a tokenizer <<< "${TOKENIZER_ARGS:-}"
    DATA=(--data-path "$DATA_PATH" "${tokenizer[@]}")
else
    DATA=(--mock-data --vocab-size 32000)
fi
ARGS=(
    --num-layers "$LAYERS" --hidden-size "$HIDDEN" --ffn-hidden-size "$FFN" --num-attention-heads "$HEADS"
    --group-query-attention --num-query-groups "$KV_GROUPS" --seq-length "$SEQ" --max-position-embeddings "$SEQ"
    --swiglu --normalization RMSNorm --position-embedding-type rope --untie-embeddings-and-output-weights
    --disable-bias-linear --hidden-dropout 0 --attention-dropout 0
    --tensor-model-parallel-size "$TP" --pipeline-model-parallel-size "$PP"
    --micro-batch-size "${MBS:-1}" --global-batch-size "${GBS:-8}" --train-iters "${ITERS:-1000}"
    --lr "${LR:-3e-4}" --min-lr "${MIN_LR:-3e-5}" --lr-decay-style cosine --lr-warmup-fraction 0.01
    --adam-beta2 0.95 --weight-decay 0.1 --clip-grad 1.0 --bf16 --grad-reduce-in-bf16
    --recompute-granularity full --recompute-method uniform --recompute-num-layers 1
    "${DATA[@]}" --log-interval 1 --log-throughput
    --save "${CKPT:-$RUN/ckpt}" --load "${CKPT:-$RUN/ckpt}" --save-interval "${SAVE_INTERVAL:-500}"
    "${MOMENTS_FLAGS[@]}"
    --offload-tiers gpu,host,nvme --offload-gpu-cache-gb auto --offload-host-cache-gb "$HOST_GB"
    --offload-nvme-path "${DISK:-$RUN/nvme}"
    "$@"
)

if [ "${DRY_RUN:-0}" != 1 ]; then
    cd "$REPO"
    source tools/setup_env.sh
    if [ "${PLAN:-0}" = 1 ] && [ -z "${GPU_GB:-}" ]; then  # plan for this machine's GPU where it has one
        GPU_GB=$(python -c "import torch; cuda = torch.cuda.is_available()
print(torch.cuda.get_device_properties(0).total_memory / 2**30 if cuda else '')")
    fi
fi
if [ "${PLAN:-0}" = 1 ]; then
    COMMAND=(python tools/plan_offload.py --gpus-per-node "$NPROC" ${GPU_GB:+--gpu-memory-gb "$GPU_GB"} "${ARGS[@]}")
else
    COMMAND=(python -m torch.distributed.run --standalone --nproc_per_node "$NPROC" pretrain_gpt.py "${ARGS[@]}")
fi
if [ "${DRY_RUN:-0}" = 1 ]; then
    printf '%q ' "${COMMAND[@]}"
    echo
    exit 0
fi
mkdir -p "${DISK:-$RUN/nvme}"  # the planner probes it too
exec "${COMMAND[@]}"
