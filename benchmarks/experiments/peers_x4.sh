#!/usr/bin/env bash
# One device call on the 4-GPU machine (kind nvidia-h200-x4): 4 data-parallel ranks share ONE disk.
# Ours host+disk with the default I/O tokens per tier (b: the engine's probe decides), with 1 token,
# i.e. ranks take turns (s), and with 4 tokens, i.e. no node-wide concurrency control (t); DeepSpeed ZeRO-3 offload_optimizer nvme over the same 4 ranks and disk (d);
# ours host only (a); no offload (g). Same Llama shape for all: 2.09 G params, 25 GB of fp32 state
# (ours) against 4 x 4 GB of host budget, so most of it lives on the disk; DeepSpeed needs 33 GB there.
# Needs `.whl` (megatron-core, deepspeed + deps) and `.deb` (libaio) in the device tool's carry list.
#   bash benchmarks/run_gpu.sh peers_x4 [compare_offload.py flags; later flags win, e.g. --systems btd]
# Stays within LIMIT_S seconds (default 530) from its own start, setup and plot included.
# NCCL_* (NVLink multicast off) come preset with the machine and are left as they are.
set -u
T0=$SECONDS
LIMIT_S=${LIMIT_S:-530}
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
source benchmarks/experiments/peer_env.sh || exit 1
nvidia-smi --query-gpu=index,name,memory.total --format=csv,noheader; nproc; free -g | head -2
echo "cgroup memory.max: $(cat /sys/fs/cgroup/memory.max 2>/dev/null || echo n/a) | $(env | grep '^NCCL_' | tr '\n' ' ')"
DISK=${DISK:-/var/tmp/offload_cmp}; mkdir -p "$DISK"
df -h "$DISK" | cat
python3 -c "import deepspeed, transformers, megatron.core; print('deepspeed', deepspeed.__version__, \
'| transformers', transformers.__version__, '| megatron-core', megatron.core.__version__)" 2>&1 | grep -v "^\[20"
# What is left after set-up, minus ~15 s for the plot and the archive.
BUDGET=$(( LIMIT_S - (SECONDS - T0) - 15 ))
# --host-gb: this machine's memory grows on demand, so MemAvailable reads low at start; 400 of its 512 GiB.
set -o pipefail
python3 benchmarks/peers.py --nproc 4 --systems bdstag \
    --layers 28 --hidden 2560 --ffn 6912 --heads 20 --kv-heads 4 --vocab 32000 --seq 2048 \
    --micro-batch 4 --host-budget-gb 4 --host-gb 400 --iters 3 \
    --disk-dir "$DISK" --out "$OUT" --budget-s $BUDGET "$@" 2>&1 | tee "$OUT/compare.log"
python3 benchmarks/peers_plot.py "$OUT/compare_offload.json" "$OUT/phases.png"
rm -rf "$DISK"
echo "gpu_compare_x4.sh: $(( SECONDS - T0 )) s"
