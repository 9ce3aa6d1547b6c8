#!/usr/bin/env bash
# The params staged in host memory while DDP builds its buffers (forced), against the same run built in place, bit for bit.
# A 1.5 B Llama shape on one GPU, 5 iterations, megatron-core's unfused attention (SDPA's flash backward is not
# reproducible run to run), offload host tier streamed through the GPU; MLP_OFFLOAD_STAGE_PARAMS=1 forces the
# staging that build_model does where DDP's param and grad buffers would not fit beside the params (101.9 B at TP4).
#   bash benchmarks/run_gpu.sh stage_params      (device tool, one GPU, carry [".whl"]); DRY_RUN=1 on CPU
set -u
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 PYTHONPATH=${PYTHONPATH:-$PWD}
if [ "${DRY_RUN:-0}" = 1 ]; then
  SHAPE="--num-layers 2 --hidden-size 64 --ffn-hidden-size 128 --num-attention-heads 4 --seq-length 64
    --max-position-embeddings 64"; DEVICE="--device cpu --offload-adam-kernel single"
else
  SHAPE="--num-layers 24 --hidden-size 2304 --ffn-hidden-size 6144 --num-attention-heads 18 --seq-length 2048
    --max-position-embeddings 2048"; DEVICE="--device cuda"
fi
for kind in in_place staged; do
  [ $kind = staged ] && export MLP_OFFLOAD_STAGE_PARAMS=1 || unset MLP_OFFLOAD_STAGE_PARAMS
  timeout ${LIMIT:-120} torchrun --nproc_per_node 1 --master_port ${PORT:-29541} pretrain_gpt.py $SHAPE \
    --attention-backend local --swiglu --normalization RMSNorm --position-embedding-type rope \
    --untie-embeddings-and-output-weights --disable-bias-linear --hidden-dropout 0 --attention-dropout 0 \
    --vocab-size 32000 --micro-batch-size 1 --global-batch-size 2 --train-iters 5 --lr 3e-4 --clip-grad 1.0 --bf16 \
    --mock-data --seed 1234 --log-interval 1 $DEVICE --offload-tiers host --offload-update gpu \
    --no-store-param-remainders --loss-log "$OUT/.loss_$kind.jsonl" 2>&1 | grep -v -i warn > "$OUT/stage_$kind.log"
  echo "$kind exit ${PIPESTATUS[0]}"; grep -E "staged|rror" "$OUT/stage_$kind.log" | cut -c1-300
done
python3 - "$OUT" <<'PY' | tee "$OUT/stage_params.txt"
import json, pathlib, sys
out = pathlib.Path(sys.argv[1])
runs = {k: [(r["loss"], r.get("grad_norm")) for r in map(json.loads, (out / f".loss_{k}.jsonl").read_text().splitlines())]
        for k in ("in_place", "staged") if (out / f".loss_{k}.jsonl").exists()}
print(runs)
same = len(runs) == 2 and runs["in_place"] == runs["staged"] and len(runs["staged"]) == 5
print(f"{'PASS' if same else 'FAIL'}: staged params give the in-place run's losses and grad norms bit for bit")
PY
rm -f "$OUT"/.loss_*.jsonl
