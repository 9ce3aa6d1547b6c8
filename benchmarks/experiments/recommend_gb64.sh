#!/usr/bin/env bash
# The planner's recommendation against the default flags (issue 31): 10.24 B on one H200 at global batch 64, one call.
# The 10.24 B Llama of gpu_update.sh (36 layers, hidden 5120, FFN 13824, 40 heads, 8 KV groups, seq 2048), bf16
# moments, gpu,host,nvme, host 74 GiB, global batch 64 (64 micro-batches of 1 on one GPU):
#   default   recompute full, micro-batch 1, gpu tier auto (the README command)
#   chosen    what tools/plan_offload.py --recommend picks for global batch 64 on this node (run here, its choice
#             turned into flags by planner_choice.py; skipped where it is the default)
# ITERS (default 4) iterations each under `timeout LIMIT` (default 200 s); then measured tokens/s (iterations 3
# on, else the last) beside the planner's predicted tokens/s of each. Compute is planned at TFLOPS (334.5: the
# H200 with SDPA, from this command at global batch 1; docs/benchmarks.md §4), the device's and the disk's rates
# as that run's log printed them; the CPU's conversion rate is measured here.
# Run: bash benchmarks/run_gpu.sh recommend_gb64   (device tool, kind nvidia-h200, carry [".whl"]);
#      DRY_RUN=1 runs a tiny shape on CPU. PLAN_EXTRA: more planner flags (e.g. --host-memory-gb 125).
set -u -o pipefail  # a planner that chose nothing stops its part
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 PYTHONPATH=${PYTHONPATH:-$PWD}
PY=${PYTHON:-python3}
DISK=${DISK:-/var/tmp/offload_recommend}; rm -rf "$DISK"; mkdir -p "$DISK"
GB=${GB:-64}
if [ "${DRY_RUN:-0}" = 1 ]; then
  SHAPE="--num-layers 2 --hidden-size 64 --ffn-hidden-size 128 --num-attention-heads 4 --num-query-groups 2
    --seq-length 64 --max-position-embeddings 64"; SEQ=64
  DEVICE="--device cpu"; TIERS="host,nvme"; HOST_GB=0.0005; SUB=20000; LIMIT=${LIMIT:-200}
  MACHINE="--gpu-memory-gb 8 --host-memory-gb 16 --adam-gelems 1 --convert-gelems 1 --offload-bandwidths nvme=1:1"
else
  SHAPE="--num-layers 36 --hidden-size 5120 --ffn-hidden-size 13824 --num-attention-heads 40 --num-query-groups 8
    --seq-length 2048 --max-position-embeddings 2048"; SEQ=2048
  DEVICE="--device cuda"; TIERS="gpu,host,nvme --offload-gpu-cache-gb auto"; HOST_GB=${HOST_GB:-74}
  SUB=100000000; LIMIT=${LIMIT:-200}
  # docs/results/gpu_2026-11-26/call6_10b_bf16_onepass.log's start-up line (tests/unit/test_plan_replay.py)
  MACHINE="--gpu-memory-gb 140.4 --gpu-tflops ${TFLOPS:-334.5} --offload-bandwidths nvme=1.90:1.95 --adam-gelems 3.50
    --gpu-adam-gelems 104.70 --gpu-streamed-gelems 7.97 --gpu-streamed-beside-gelems 7.15 --cpu-beside-gelems 0.25"
fi
FLAGS="$SHAPE --group-query-attention --swiglu --normalization RMSNorm --position-embedding-type rope
  --untie-embeddings-and-output-weights --disable-bias-linear --hidden-dropout 0 --attention-dropout 0 --vocab-size 32000
  --micro-batch-size 1 --lr 3e-4 --adam-beta2 0.95 --weight-decay 0.1 --clip-grad 1.0 --bf16 --mock-data --seed 1234
  --log-interval 1 --recompute-granularity full --recompute-method uniform --recompute-num-layers 1 $DEVICE
  --use-precision-aware-optimizer --exp-avg-dtype bf16 --exp-avg-sq-dtype bf16 --offload-tiers $TIERS
  --offload-host-cache-gb $HOST_GB --offload-nvme-path $DISK --offload-subgroup-size $SUB --offload-io-threads 8"
echo "== the planner at global batch $GB"
$PY tools/plan_offload.py --gpus-per-node 1 $MACHINE ${PLAN_EXTRA:-} --recommend --json $FLAGS --global-batch-size $GB \
  > "$OUT/recommend_plan.json" 2> "$OUT/.plan.err"
$PY benchmarks/experiments/planner_choice.py "$OUT/recommend_plan.json" "$OUT/.chosen" 8 | tee "$OUT/recommend_plan.txt" \
  || { head -c 600 "$OUT/.plan.err"; exit 1; }
mapfile -t CHOSEN < "$OUT/.chosen"
DEFAULT=($FLAGS)
SAME=$($PY -c "import json, sys; print(json.load(open(sys.argv[1]))['recommendation']['chosen']['changed'] == 0)" \
  "$OUT/recommend_plan.json")
source benchmarks/experiments/memory_watch.sh
source benchmarks/experiments/iteration_lines.sh
for side in default chosen; do
  if [ $side = chosen ] && [ "$SAME" = True ]; then echo "chosen: the default flags (one run)"; break; fi
  [ $side = default ] && RUN=("${DEFAULT[@]}") || RUN=("${CHOSEN[@]}")
  echo "== $side"
  rm -rf "$DISK"/*
  watch_memory "$side"
  timeout $LIMIT torchrun --nproc_per_node 1 --master_port ${PORT:-29533} pretrain_gpt.py "${RUN[@]}" \
    --global-batch-size $GB --train-iters ${ITERS:-4} > "$OUT/.run.log" 2>&1
  echo "$side exit $?"
  rm -f "$OUT/.watch"; sleep 2; cat "$OUT/.peak"; echo
  grep -v -i warn "$OUT/.run.log" | grep -E "offload rank 0|gpu tier auto|start-up \(s\)|iteration +[0-9]|rror|Killed|refus" \
    | cut -c1-900 > "$OUT/recommend_$side.log"
  iteration_lines "$OUT/recommend_$side.log"
  grep -E "rror|Killed|refus" "$OUT/recommend_$side.log" | head -3
done
$PY - "$OUT" "$GB" "$SEQ" <<'PY' | tee "$OUT/recommend_tokens.txt"
import json, pathlib, re, statistics, sys
out, gb, seq = pathlib.Path(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
plan = json.loads((out / "recommend_plan.json").read_text())
chosen = plan["recommendation"]["chosen"]
predicted = {"default": plan["tokens_per_s"][str(gb)] if plan["fits"] else None, "chosen": chosen["tokens_per_s"]}
print(f"global batch {gb}: side, measured tokens/s (iterations), predicted tokens/s")
for side, label in (("default", "recompute full, micro-batch 1, tiers as given"), ("chosen", chosen["candidate"])):
    log = out / f"recommend_{side}.log"
    ms = [float(x) for x in re.findall(r"elapsed time per iteration \(ms\): ([\d.]+)", log.read_text())] if log.exists() else []
    steady = ms[2:] or ms[-1:]  # iteration 1 reads the state in and learns the gpu tier; 2 settles it
    measured = f"{gb * seq / (statistics.mean(steady) / 1e3):,.0f} ({len(steady)})" if steady else "no iterations"
    guess = f"{predicted[side]:,.0f}" if predicted[side] else "does not fit"
    print(f"  {side} ({label}): {measured}, predicted {guess}")
PY
rm -rf "$DISK" "$OUT/.run.log" "$OUT/.peak" "$OUT/.plan.err" "$OUT/.chosen" "$OUT/.chosen.tflops"
