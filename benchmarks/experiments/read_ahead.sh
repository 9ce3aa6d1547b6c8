#!/usr/bin/env bash
# Host state read ahead into GPU memory (--offload-read-ahead-gb) against the same runs without it, bit for bit.
# A 0.7 B Llama shape on one GPU, 8 iterations, megatron-core's unfused attention (SDPA's flash backward is not
# reproducible run to run), host tier streamed through the GPU with the default state (16-bit remainders, fp32
# moments), in series and with --offload-overlap-forward; the read-ahead's copies race the updates' copies out on
# separate CUDA streams, which only a GPU shows.
#   bash benchmarks/run_gpu.sh read_ahead      (device tool, one GPU, carry [".whl"]); DRY_RUN=1 on CPU
set -u
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 PYTHONPATH=${PYTHONPATH:-$PWD}
if [ "${DRY_RUN:-0}" = 1 ]; then
  SHAPE="--num-layers 2 --hidden-size 64 --ffn-hidden-size 128 --num-attention-heads 4 --seq-length 64
    --max-position-embeddings 64"; DEVICE="--device cpu --offload-adam-kernel single"; SUB=5000; RA=0.0002
else
  SHAPE="--num-layers 12 --hidden-size 2048 --ffn-hidden-size 5632 --num-attention-heads 16 --seq-length 2048
    --max-position-embeddings 2048"; DEVICE="--device cuda"; SUB=50000000; RA=2
fi
for kind in serial serial_ra overlap overlap_ra; do
  FLAGS=""
  case $kind in overlap*) FLAGS="--offload-overlap-forward";; esac
  case $kind in *_ra) FLAGS="$FLAGS --offload-read-ahead-gb $RA";; esac
  timeout ${LIMIT:-150} torchrun --nproc_per_node 1 --master_port ${PORT:-29543} pretrain_gpt.py $SHAPE \
    --attention-backend local --swiglu --normalization RMSNorm --position-embedding-type rope \
    --untie-embeddings-and-output-weights --disable-bias-linear --hidden-dropout 0 --attention-dropout 0 \
    --vocab-size 32000 --micro-batch-size 1 --global-batch-size 2 --train-iters 8 --lr 3e-4 --clip-grad 1.0 --bf16 \
    --mock-data --seed 1234 --log-interval 1 $DEVICE --offload-tiers host --offload-update gpu \
    --offload-subgroup-size $SUB $FLAGS --loss-log "$OUT/.loss_$kind.jsonl" 2>&1 | grep -v -i warn > "$OUT/read_ahead_$kind.log"
  echo "$kind exit ${PIPESTATUS[0]}"; grep -E "read-ahead|rror" "$OUT/read_ahead_$kind.log" | cut -c1-400 | tail -3
  grep -E "iteration +[0-9]+/" "$OUT/read_ahead_$kind.log" | tail -2 | cut -c1-400
done
python3 - "$OUT" <<'PY' | tee "$OUT/read_ahead.txt"
import json, pathlib, sys
out = pathlib.Path(sys.argv[1])
kinds = ("serial", "serial_ra", "overlap", "overlap_ra")
runs = {k: [(r["loss"], r.get("grad_norm")) for r in map(json.loads, (out / f".loss_{k}.jsonl").read_text().splitlines())]
        for k in kinds if (out / f".loss_{k}.jsonl").exists()}
for k, v in runs.items():
    print(k, v)
same = len(runs) == 4 and all(runs[k] == runs["serial"] for k in kinds) and len(runs["serial"]) == 8
print(f"{'PASS' if same else 'FAIL'}: read ahead in series and overlapped give the runs without it bit for bit")
PY
rm -f "$OUT"/.loss_*.jsonl
