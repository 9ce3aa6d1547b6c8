#!/usr/bin/env bash
# One device call on two GPUs (nvidia-h200-x2), issue 12's CUDA paths:
#  V: the interleaved pipeline, PP2 x VPP2, without and with offload (host+nvme), and PP2 without VPP;
#  T: upstream Megatron-LM's own checkpoint (tests/data/upstream_gpt) at TP2: refused in one line
#     directly, then converted to the offloaded form at TP1 and resumed at TP2 on two GPUs;
#  A: --async-save with offload: the pause training had against a synchronous save of the same state.
# ONLY_V=1: part V alone. Needs megatron-core (and psutil) wheels in .whl/: device tool carry [".whl"].
set -u
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 PYTHONWARNINGS=ignore
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader; nproc; free -g | head -2
W=/var/tmp/issue12; rm -rf $W; mkdir -p $W; df -h $W | cat
T0=$SECONDS
lines() { grep -E "$1" "$2" | cut -c1-240; }

echo "== V: interleaved pipeline on 2 GPUs"
MODEL="--num-layers 8 --hidden-size 1024 --num-attention-heads 16 --group-query-attention --num-query-groups 4
 --swiglu --normalization RMSNorm --position-embedding-type rope --untie-embeddings-and-output-weights
 --disable-bias-linear --seq-length 1024 --max-position-embeddings 1024 --vocab-size 32000
 --micro-batch-size 2 --global-batch-size 16 --train-iters 10 --lr 3e-4 --min-lr 3e-5 --lr-warmup-iters 2
 --weight-decay 0.1 --adam-beta2 0.95 --clip-grad 1.0 --bf16 --mock-data --device cuda --log-interval 1
 --seed 1234 --use-distributed-optimizer --hidden-dropout 0 --attention-dropout 0
 --pipeline-model-parallel-size 2"
OFF="--offload-tiers host,nvme --offload-host-cache-gb 4 --offload-nvme-path $W/nvme --offload-io-threads 8"
mkdir -p $W/nvme
for case in "pp2:" "vpp2:--num-layers-per-virtual-pipeline-stage 2" "vpp2_offload:--num-layers-per-virtual-pipeline-stage 2 $OFF"; do
  name=${case%%:*}; flags=${case#*:}
  torchrun --nproc_per_node 2 pretrain_gpt.py $MODEL $flags --loss-log $OUT/V_$name.jsonl > $W/V_$name.log 2>&1
  echo "$name exit $?"; lines "iteration +(1|10)/|^error" $W/V_$name.log
done
python3 - "$OUT" <<'PY'
import json, sys
load = lambda n: [json.loads(l) for l in open(f"{sys.argv[1]}/V_{n}.jsonl")]
try:
    a, b, c = load("pp2"), load("vpp2"), load("vpp2_offload")
except OSError as e:
    sys.exit(f"missing: {e}")
for x, y, z in zip(a, b, c):
    print(f"iter {x['iteration']:2d} pp2 {x['loss']:.6f} vpp2 {y['loss']:.6f} vpp2+offload {z['loss']:.6f} "
          f"diff {z['loss'] - y['loss']:+.2e}")
PY
echo "V done at $(( SECONDS - T0 )) s"

[ -n "${ONLY_V:-}" ] && exit 0
echo "== T: upstream's checkpoint at TP2"
mkdir -p $W/up && tar -xzf tests/data/upstream_gpt/upstream_iter4.tar.gz -C $W/up
. benchmarks/upstream_flags.sh
UOFF() { mkdir -p $1; echo "--offload-tiers host,nvme --offload-host-cache-gb 0.002 --offload-nvme-path $1 --offload-subgroup-size 20000"; }
torchrun --nproc_per_node 2 pretrain_gpt.py $UPSTREAM_COMMON --device cuda --tensor-model-parallel-size 2 \
  --data-cache-path $W/cache --load $W/up/up4 --save $W/t_direct $(UOFF $W/t1) > $W/T_direct.log 2>&1
echo "direct exit $?"; grep -E "^error" $W/T_direct.log | cut -c1-300
python3 tools/convert_offload_checkpoint.py --to offload --load $W/up/up4 --save $W/t_conv --nproc 1 -- \
  $(echo $UPSTREAM_COMMON | sed 's/--train-iters 8//') --device cuda --data-cache-path $W/cache $(UOFF $W/t2) \
  > $W/T_convert.log 2>&1; echo "convert exit $?"; tail -2 $W/T_convert.log | cut -c1-240
torchrun --nproc_per_node 2 pretrain_gpt.py $UPSTREAM_COMMON --device cuda --tensor-model-parallel-size 2 \
  --make-vocab-size-divisible-by 64 --data-cache-path $W/cache --load $W/t_conv --save $W/t_tp2 \
  --loss-log $OUT/T_tp2.jsonl $(UOFF $W/t3) > $W/T_tp2.log 2>&1
echo "tp2 exit $?"; lines "iteration +[0-9]+/|^error" $W/T_tp2.log
echo "upstream's own log, same iterations:"; grep -E "iteration +[5-8]/" docs/results/upstream_checkpoint_h100_2026-11-22/upstream_train.log | grep -oE "iteration +[0-9]+|lm loss: [0-9.E+-]+" | paste - -
echo "T done at $(( SECONDS - T0 )) s"
