#!/usr/bin/env bash
# The main job: train a small Llama-style GPT on the shipped corpus with the optimizer state
# offloaded to host memory + two file tiers (a local directory for "nvme", /dev/shm for "pfs").
# Uses every GPU there is, or 2 CPU processes (gloo) when there is none.
set -euo pipefail
REPO="$(cd "$(dirname "$0")/.." && pwd)"
cd "$REPO"
source tools/setup_env.sh
RUN="${RUN_DIR:-$REPO/runs/quickstart}"
# Stand-ins for node-local NVMe and a parallel file system. On one disk the planner would rightly
# put everything on one of them (they share its bandwidth); /dev/shm is another device.
PFS="${PFS_DIR:-$RUN/pfs}"
if [ -z "${PFS_DIR:-}" ] && [ -w /dev/shm ]; then PFS=/dev/shm/mlp-offload-quickstart-$(id -u); fi
mkdir -p "$RUN/data" "$RUN/nvme" "$PFS"
[ -f "$RUN/data/corpus_text_document.bin" ] || \
    python tools/preprocess_data.py --input examples/data/corpus.jsonl --output-prefix "$RUN/data/corpus" \
        --tokenizer-type ByteLevelTokenizer --append-eod --workers 2
if python -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)"; then
    NPROC=$(python -c "import torch; print(torch.cuda.device_count())"); DEVICE=cuda
else
    NPROC=2; DEVICE=cpu
fi
python -m torch.distributed.run --standalone --nproc_per_node "$NPROC" pretrain_gpt.py \
    --num-layers 4 --hidden-size 128 --num-attention-heads 4 --group-query-attention --num-query-groups 2 \
    --swiglu --normalization RMSNorm --position-embedding-type rope --untie-embeddings-and-output-weights \
    --disable-bias-linear --seq-length 128 --max-position-embeddings 128 \
    --micro-batch-size 4 --global-batch-size 16 --train-iters "${TRAIN_ITERS:-60}" \
    --lr 3e-3 --min-lr 3e-4 --lr-decay-style cosine --lr-warmup-iters 5 --weight-decay 0.1 \
    --adam-beta2 0.95 --clip-grad 1.0 --bf16 --device "$DEVICE" \
    --tokenizer-type ByteLevelTokenizer --data-path "$RUN/data/corpus_text_document" --split 95,5,0 --eval-interval 20 --eval-iters 2 \
    --log-interval 5 --save "$RUN/ckpt" --save-interval 30 --load "$RUN/ckpt" \
    --offload-tiers host,nvme,pfs --offload-nvme-path "$RUN/nvme" --offload-pfs-path "$PFS" \
    --offload-host-cache-gb 0.004 --offload-subgroup-size 50000 --offload-probe-mb 64 "$@"
