#!/usr/bin/env bash
# One GPU: the optimizer state over spare HBM (the gpu tier, sized from the training's real peak), pinned host
# memory and a local disk; the update runs where it is fastest. Defaults: the 10.24 B Llama shape of
# docs/benchmarks.md §14 (36 layers, hidden 5120, FFN 13824, 40 heads, 8 KV groups, seq 2048), bf16 moments, 74 GiB
# of host memory for the state: one H200 with 128 GiB of RAM. Another GPU or model: plan it first (PLAN=1).
#   bash examples/one_gpu.sh                        # train (mock data; DATA_PATH=prefix for yours)
#   PLAN=1 bash examples/one_gpu.sh                 # will it fit? where every byte goes, the predicted iteration
#   DRY_RUN=1 bash examples/one_gpu.sh              # print the command only
#   HOST_GB=40 MOMENTS=fp8 bash examples/one_gpu.sh --train-iters 100   # settings: examples/recipe.sh
NAME=one_gpu NPROC=1 TP=1 PP=1
LAYERS=${LAYERS:-36} HIDDEN=${HIDDEN:-5120} FFN=${FFN:-13824} HEADS=${HEADS:-40}
KV_GROUPS=${KV_GROUPS:-8} SEQ=${SEQ:-2048}
HOST_GB=${HOST_GB:-74}
source "$(dirname "$0")/recipe.sh"
