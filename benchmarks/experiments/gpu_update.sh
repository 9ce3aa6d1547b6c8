#!/usr/bin/env bash
# One device call (issue 19): the update on the GPU and spare HBM as the top tier.
#  (a) correctness: a small GPT a few iterations with megatron-core's optimizer (no offload), ours with
#      --offload-tiers gpu,host (the whole state in the gpu tier: losses must be bit-identical), and ours
#      host-only with every subgroup updated on the GPU from streamed host state (--offload-update gpu),
#      both with the fp32 master (--no-store-param-remainders); then the same two with the default 16-bit
#      remainders against megatron-core whose main->model copy rounds half away (the test's reference,
#      tests/integration/half_away_megatron.py);
#  (b) the 10.24 B Llama shape, gpu,host,nvme with --offload-gpu-cache-gb auto: bf16 moments, then lossless.
# Prints iteration times, the engine's predicted vs measured update and split, host/GPU memory peaks.
# PART=a runs (a) only, PART=b (b) only (default both).
# Run: PYTHONPATH=/tmp/site:$PWD bash benchmarks/experiments/gpu_update.sh   (megatron-core importable)
# Dry run on a CPU machine: DRY_RUN=1 bash benchmarks/experiments/gpu_update.sh (tiny shapes, --device cpu).
# Writes at most 8 flat files to $OUT.
set -u
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 PYTHONPATH=${PYTHONPATH:-$PWD}
DRY=${DRY_RUN:-0}
PY=${PYTHON:-python3}
DISK=${DISK:-/var/tmp/offload_gpu_update}; rm -rf "$DISK"; mkdir -p "$DISK"
if [ "$DRY" = 1 ]; then
  DEVICE="--device cpu"; ITERS_A=3; ITERS_B=3; LIMIT_A=300; LIMIT_B=300
  SMALL="--num-layers 2 --hidden-size 64 --ffn-hidden-size 128 --num-attention-heads 4 --seq-length 64 --max-position-embeddings 64"
  BIG="--num-layers 2 --hidden-size 128 --ffn-hidden-size 256 --num-attention-heads 8 --group-query-attention --num-query-groups 2 --seq-length 64 --max-position-embeddings 64"
  GPU_GB=1; HOST_GB=0.05; SUB=1000000
else
  DEVICE="--device cuda"; ITERS_A=${ITERS_A:-5}; ITERS_B=${ITERS_B:-4}; LIMIT_A=${LIMIT_A:-150}; LIMIT_B=${LIMIT_B:-200}
  SMALL="--num-layers 4 --hidden-size 512 --ffn-hidden-size 1376 --num-attention-heads 8 --seq-length 512 --max-position-embeddings 512"
  BIG="--num-layers 36 --hidden-size 5120 --ffn-hidden-size 13824 --num-attention-heads 40 --group-query-attention --num-query-groups 8 --seq-length 2048 --max-position-embeddings 2048"
  GPU_GB=20; HOST_GB=${HOST_GB:-74}; SUB=100000000
fi
COMMON="--swiglu --normalization RMSNorm --position-embedding-type rope --untie-embeddings-and-output-weights
  --disable-bias-linear --hidden-dropout 0 --attention-dropout 0 --vocab-size 32000 --micro-batch-size 1 --global-batch-size 1
  --lr 3e-4 --adam-beta2 0.95 --weight-decay 0.1 --clip-grad 1.0 --bf16 --mock-data --seed 1234 --log-interval 1
  $DEVICE"  # --num-workers: the default (2), as users run it
RECOMPUTE="--recompute-granularity full --recompute-method uniform --recompute-num-layers 1"

source benchmarks/experiments/memory_watch.sh
run() {  # $1 label, $2 limit, rest: flags
  local label=$1 limit=$2; shift 2
  watch_memory "$label"
  timeout "$limit" torchrun --nproc_per_node 1 --master_port ${PORT:-29511} ${SCRIPT:-pretrain_gpt.py} $COMMON "$@" > "$OUT/.run.log" 2>&1
  echo "$label exit $?"; rm -f "$OUT/.watch"; sleep 2; cat "$OUT/.peak" | tee -a "$OUT/memory_peaks.txt"
}
if [ "${PART:-ab}" != b ]; then
echo "== (a) correctness: losses of megatron-core (no offload) vs ours, gpu tier and GPU-streamed"
KINDS=${KINDS:-mcore gpu stream mcorehalf gpurem streamrem}
for kind in $KINDS; do
  SCRIPT=pretrain_gpt.py
  case $kind in
    mcore) FLAGS="--use-distributed-optimizer";;
    gpu) FLAGS="--offload-tiers gpu,host --offload-gpu-cache-gb $GPU_GB --offload-update cpu --no-store-param-remainders";;
    stream) FLAGS="--offload-tiers host --offload-update gpu --offload-subgroup-size $SUB --no-store-param-remainders";;
    mcorehalf) FLAGS="--use-distributed-optimizer"; SCRIPT=tests/integration/half_away_megatron.py;;
    gpurem) FLAGS="--offload-tiers gpu,host --offload-gpu-cache-gb $GPU_GB --offload-update cpu";;
    streamrem) FLAGS="--offload-tiers host --offload-update gpu --offload-subgroup-size $SUB";;
    splitrem) FLAGS="--offload-tiers host --offload-update auto --offload-subgroup-size 2000000";;
    gpuremov) FLAGS="--offload-tiers gpu,host --offload-gpu-cache-gb $GPU_GB --offload-update cpu --offload-overlap-forward";;
    streamremov) FLAGS="--offload-tiers host --offload-update gpu --offload-subgroup-size $SUB --offload-overlap-forward";;
  esac
  SCRIPT=$SCRIPT run "small-$kind" $LIMIT_A $SMALL --train-iters $ITERS_A $FLAGS --loss-log "$OUT/.loss_$kind.jsonl"
  grep -E "offload rank|predicted|iteration |update split" "$OUT/.run.log" | grep -v -i warn | cut -c1-400 >> "$OUT/correctness.log"
  grep -E "rror|Traceback" "$OUT/.run.log" | head -5
done
$PY - "$OUT" <<'PY' | tee "$OUT/correctness_losses.txt"
import json, sys, pathlib
out = pathlib.Path(sys.argv[1])
kinds = ("mcore", "gpu", "stream", "mcorehalf", "gpurem", "streamrem", "splitrem", "gpuremov", "streamremov")
runs = {k: {r["iteration"]: r["loss"] for r in map(json.loads, (out / f".loss_{k}.jsonl").read_text().splitlines())}
        if (out / f".loss_{k}.jsonl").exists() else {} for k in kinds}
print("iteration  " + "  ".join(f"{k:24}" for k in kinds))
for it in sorted(runs["mcore"] or runs["mcorehalf"]):
    print(f"{it:9d}  " + "  ".join(f"{runs[k].get(it, float('nan'))!r:24}" for k in kinds))
for k, ref in (("gpu", "mcore"), ("stream", "mcore"), ("gpurem", "mcorehalf"), ("streamrem", "mcorehalf"),
               ("splitrem", "mcorehalf"), ("gpuremov", "mcorehalf"), ("streamremov", "mcorehalf")):
    if not runs[k]:
        continue  # (not run this time)
    same = runs[k] == runs[ref] and runs[k] != {}
    print(f"{k}: {'BIT-IDENTICAL' if same else 'DIFFERENT'} to {ref} ({len(runs[k])} iterations)")
PY
fi
if [ "${PART:-ab}" != a ]; then
echo "== (b) the 10.24 B shape, gpu,host,nvme, --offload-gpu-cache-gb auto"
for state in ${STATES:-bf16 lossless}; do
  PREC=""; [ $state = bf16 ] && PREC="--use-precision-aware-optimizer --exp-avg-dtype bf16 --exp-avg-sq-dtype bf16"
  run "10b-$state${LABEL:+-$LABEL}" $LIMIT_B $BIG $RECOMPUTE --train-iters $ITERS_B $PREC ${EXTRA:-} \
    --offload-tiers gpu,host,nvme --offload-nvme-path "$DISK" --offload-gpu-cache-gb ${GPU_CACHE:-auto} --offload-host-cache-gb $HOST_GB \
    --offload-subgroup-size $SUB --offload-io-threads 8 --offload-telemetry-log "$OUT/10b_${state}${LABEL:+_$LABEL}_telemetry.jsonl"
  grep -v -i warn "$OUT/.run.log" | grep -E "model parameters|attention:|offload rank|gpu tier auto|predicted|iteration |rror|Killed" \
    | cut -c1-900 | tee "$OUT/10b_${state}${LABEL:+_$LABEL}.log"
  rm -rf "$DISK"/*
done
fi
rm -rf "$DISK" "$OUT"/.loss_*.jsonl "$OUT/.run.log" "$OUT/.peak"
ls "$OUT"
