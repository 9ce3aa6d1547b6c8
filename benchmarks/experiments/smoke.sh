#!/usr/bin/env bash
# Short GPU smoke of the training loop and the offload path (a few iterations, tiny model).
set -u
mkdir -p /var/tmp/smoke/nvme
for extra in "" "--offload-tiers host,nvme --offload-nvme-path /var/tmp/smoke/nvme --offload-host-cache-gb 0.2 --offload-subgroup-size 2000000 --offload-probe-mb 64"; do
  torchrun --nproc_per_node 1 pretrain_gpt.py --num-layers 4 --hidden-size 512 --num-attention-heads 8 --seq-length 512 \
    --max-position-embeddings 512 --micro-batch-size 2 --global-batch-size 8 --train-iters 4 --lr 1e-3 --bf16 --mock-data \
    --device cuda --log-interval 1 --use-distributed-optimizer $extra 2>&1 | grep -E "^iteration|rror" | cut -c1-420
done
