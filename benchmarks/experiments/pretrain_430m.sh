#!/usr/bin/env bash
# One device call: a ~430M-parameter Llama-style GPT on one GPU, without and with offload
# (host + disk + an emulated second path on /dev/shm), 12 iterations each, same seed.
# Run from the repo root on the GPU machine, with megatron-core carried in .whl/ (see docs).
set -u
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader; nproc; free -g | head -2
DISK=${DISK:-/var/tmp/offload}; mkdir -p $DISK/nvme /dev/shm/offload-pfs
df -h $DISK /dev/shm | cat; findmnt -T $DISK -o SOURCE,FSTYPE | cat
MODEL="--num-layers 24 --hidden-size 1024 --num-attention-heads 16 --group-query-attention --num-query-groups 4 --ffn-hidden-size 4096
 --swiglu --normalization RMSNorm --position-embedding-type rope --untie-embeddings-and-output-weights
 --disable-bias-linear --seq-length 1024 --max-position-embeddings 1024 --vocab-size 32000
 --micro-batch-size 4 --global-batch-size 16 --train-iters ${ITERS:-12} --lr 3e-4 --min-lr 3e-5
 --lr-decay-style cosine --lr-warmup-iters 2 --weight-decay 0.1 --adam-beta2 0.95 --clip-grad 1.0
 --bf16 --mock-data --device cuda --log-interval 1 --seed 1234 --use-distributed-optimizer"
OFFLOAD="--offload-tiers host,nvme,pfs --offload-nvme-path $DISK/nvme --offload-pfs-path /dev/shm/offload-pfs
 --offload-host-cache-gb 2 --offload-subgroup-size 20000000 --offload-io-threads 8"
set -o pipefail
torchrun --nproc_per_node 1 pretrain_gpt.py $MODEL --loss-log $OUT/base.jsonl 2>&1 | grep -v Warning | tee $OUT/base.log | tail -8
torchrun --nproc_per_node 1 pretrain_gpt.py $MODEL $OFFLOAD --loss-log $OUT/offload.jsonl 2>&1 | grep -v Warning | tee $OUT/offload.log | tail -16
# Save at the half-way point and stop; resume in a new process with the disk tier only.
HALF=$(( ${ITERS:-12} / 2 ))
rm -rf $DISK/ckpt
torchrun --nproc_per_node 1 pretrain_gpt.py $MODEL $OFFLOAD --loss-log $OUT/resumed.jsonl --save $DISK/ckpt \
  --save-interval $HALF --exit-interval $HALF 2>&1 | grep -v Warning | grep -E "saved|error|Error" | tail -3
torchrun --nproc_per_node 1 pretrain_gpt.py $MODEL --offload-tiers nvme --offload-nvme-path $DISK/nvme \
  --offload-subgroup-size 30000000 --loss-log $OUT/resumed.jsonl --load $DISK/ckpt 2>&1 | grep -v Warning \
  | grep -E "loaded|iteration +$((HALF + 1))/|error|Error" | tail -3
du -sh $DISK/ckpt/iter_*/offload | cat
python3 - "$OUT" <<'PY'
import json, sys
out = sys.argv[1]
load = lambda n: [json.loads(l) for l in open(f"{out}/{n}.jsonl")]
for b, o, r in zip(load("base"), load("offload"), load("resumed")):
    print(f"iter {b['iteration']:3d} loss base {b['loss']:.6f} offload {o['loss']:.6f} diff {o['loss'] - b['loss']:+.2e}"
          f" | resumed {r['loss']:.6f} {'==' if r == o else '!='} offload")
PY
