#!/usr/bin/env bash
# One device call: our offload (host / host+disk / +emulated 2nd path) against DeepSpeed ZeRO-3
# (NVMe, CPU), megatron-core's CPU offload and no offload, same ~1.03 B Llama shape, floor first.
# Needs `.whl` (megatron-core, deepspeed + deps) in the device tool's carry list, and `.deb` (libaio) where
# --systems runs d (DeepSpeed's NVMe offload; in the default order).
#   bash benchmarks/run_gpu.sh peers_1b [compare_offload.py flags, e.g. --layers 16 --iters 4]
# The 3.0 B comparison with fp8 moments (issue 39), ours host 5.96 GB + disk against DeepSpeed ZeRO-3 NVMe:
#   bash benchmarks/run_gpu.sh peers_1b --systems bd --layers 28 --hidden 3072 --ffn 8192 --heads 24 --kv-heads 8 \
#     --micro-batch 1 --host-budget-gb 5.96 --iters 4 \
#     --ours-flags="--use-precision-aware-optimizer --exp-avg-dtype fp8 --exp-avg-sq-dtype fp8"
# Stays within LIMIT_S seconds (default 525) from its own start, setup and plot included.
set -u
T0=$SECONDS
LIMIT_S=${LIMIT_S:-525}
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
# DeepSpeed's NVMe system (d, in the default order) builds its async_io op against the carried libaio.
systems=abdefgc
for ((i = 1; i <= $#; i++)); do
    case "${!i}" in
        --systems=*) systems=${!i#--systems=} ;;
        --systems) j=$((i + 1)); systems=${!j:-} ;;
    esac
done
if [[ $systems == *d* ]] && ! ls .deb/*.deb >/dev/null 2>&1; then
    echo "peers_1b: --systems $systems runs DeepSpeed's NVMe offload (d), which needs libaio: carry .deb (no .deb/*.deb here)"
    exit 2
fi
source benchmarks/experiments/peer_env.sh || exit 1
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader; nproc; free -g | head -2
DISK=${DISK:-/var/tmp/offload_cmp}; mkdir -p "$DISK"
df -h "$DISK" /dev/shm | cat
python3 -c "import deepspeed, transformers, megatron.core; print('deepspeed', deepspeed.__version__, \
'| transformers', transformers.__version__, '| megatron-core', megatron.core.__version__)" 2>&1 | grep -v "^\[20"
# What is left after set-up, minus ~15 s for the plot and the archive.
BUDGET=$(( LIMIT_S - (SECONDS - T0) - 15 ))
set -o pipefail
python3 benchmarks/peers.py --disk-dir "$DISK" --shm-dir /dev/shm/offload_cmp --out "$OUT" \
    --budget-s $BUDGET "$@" 2>&1 | tee "$OUT/compare.log"
python3 benchmarks/peers_plot.py "$OUT/compare_offload.json" "$OUT/phases.png"
rm -rf "$DISK" /dev/shm/offload_cmp
echo "gpu_compare.sh: $(( SECONDS - T0 )) s"
