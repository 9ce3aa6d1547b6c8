#!/usr/bin/env bash
# One node of several GPUs: TP x PP x DP over its GPUs, each rank's optimizer state over spare HBM, pinned host
# memory and the node's local disk. Defaults: the 60.4 B Llama shape of docs/benchmarks.md §12 (70 layers, hidden
# 8192, FFN 28672, 64 heads, 8 KV groups, seq 2048) at TP2 x PP2 on four GPUs, bf16 moments, 60 GiB of host memory
# per rank: four H200s with 512 GB of RAM. Another node or model: plan it first (PLAN=1; --recommend names the
# fastest layout that fits: PLAN=1 bash examples/one_node.sh --recommend --layouts auto).
#   bash examples/one_node.sh                       # train (mock data; DATA_PATH=prefix for yours)
#   PLAN=1 bash examples/one_node.sh                # will it fit?
#   DRY_RUN=1 bash examples/one_node.sh             # print the command only
#   NPROC=8 TP=4 PP=2 HOST_GB=40 bash examples/one_node.sh    # settings: examples/recipe.sh
NAME=one_node NPROC=${NPROC:-4} TP=${TP:-2} PP=${PP:-2}
LAYERS=${LAYERS:-70} HIDDEN=${HIDDEN:-8192} FFN=${FFN:-28672} HEADS=${HEADS:-64}
KV_GROUPS=${KV_GROUPS:-8} SEQ=${SEQ:-2048}
HOST_GB=${HOST_GB:-60}
source "$(dirname "$0")/recipe.sh"
