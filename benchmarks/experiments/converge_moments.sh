#!/usr/bin/env bash
# Convergence by moment format: a 129 M GPT, 2,000 steps on Python source text, fp32 vs bf16 vs 8-bit moments.
# Issue 39 item 2. Real text available offline: the Python standard library's and the installed packages' .py
# files, tokenized by the project's byte-level tokenizer (tools/preprocess_data.py). Model: 12 layers, hidden 896,
# SwiGLU FFN 2816, 14 heads, seq 1024, byte vocab (129 M params); global batch 32 (32 K tokens a step), cosine LR
# 6e-4 -> 6e-5, 100 warm-up steps, clip 1.0, --bf16, state in host memory (--offload-tiers host). Validation: 10
# batches every 250 steps on a 2% split, and at the end. The variants run one after another on one GPU.
#   bash benchmarks/run_gpu.sh converge_moments        (device tool, one H200, carry [".whl"]; ~2-3 min a variant)
#   VARIANTS="fp32 bf16 fp8" ITERS=2000 ...             (defaults)
#   DRY_RUN=1 bash benchmarks/experiments/converge_moments.sh   (tiny model, 20 steps, 2 CPU processes)
#   CORPUS_ONLY=1 ...                                   builds the corpus in WORK and stops
#   CHAIN=1 ...   each variant saves where it stops (--exit-duration-in-mins: LIMIT less 60 s for the save) in
#                 WORK/ckpt_<variant> and resumes from there when run again on the same machine (a warm one keeps
#                 /var/tmp): 2,000 steps over calls of 600 s. Logs continue; the resume is bit-exact (GPU suite)
# Writes $OUT/converge_<variant>.jsonl (per-step losses), $OUT/converge_<variant>.log (console: validation lines)
# and $OUT/converge_summary.txt; benchmarks/plot_convergence.py draws the PNG from them.
set -u
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 PYTHONPATH=${PYTHONPATH:-$PWD} PYTHONWARNINGS=ignore
PY=${PYTHON:-python3}
WORK=${WORK:-/var/tmp/converge}; mkdir -p "$WORK"
T0=$SECONDS
if [ "${DRY_RUN:-0}" = 1 ]; then
  MODEL="--num-layers 2 --hidden-size 64 --ffn-hidden-size 128 --num-attention-heads 4 --seq-length 128
    --max-position-embeddings 128"
  ITERS=${ITERS:-20}; GBS=8; EVAL="--eval-interval 10 --eval-iters 2"; DEVICE="--device cpu"; NPROC=2; MB=4
  CORPUS_MB=${CORPUS_MB:-2}; export OMP_NUM_THREADS=1
else
  MODEL="--num-layers 12 --hidden-size 896 --ffn-hidden-size 2816 --num-attention-heads 14 --seq-length 1024
    --max-position-embeddings 1024"
  ITERS=${ITERS:-2000}; GBS=32; EVAL="--eval-interval 250 --eval-iters 10"; DEVICE="--device cuda"; NPROC=1; MB=8
  CORPUS_MB=${CORPUS_MB:-120}
fi
# The corpus: .py files of the standard library and site-packages, in a fixed order, up to CORPUS_MB.
if [ ! -f "$WORK/corpus_text_document.bin" ]; then
  $PY - "$WORK/corpus.jsonl" "$CORPUS_MB" <<'PY'
import json, os, sys, sysconfig
out, limit = sys.argv[1], float(sys.argv[2]) * 1e6
roots = [sysconfig.get_paths()["stdlib"]] + sorted({p for p in sys.path if p.endswith("-packages") and os.path.isdir(p)})
total = files = 0
with open(out, "w") as f:
    for root in roots:
        for d, dirs, names in os.walk(root):
            dirs.sort()
            for name in sorted(names):
                if not name.endswith(".py") or total >= limit:
                    continue
                try:
                    text = open(os.path.join(d, name), encoding="utf-8").read()
                except (UnicodeDecodeError, OSError):
                    continue
                if len(text) < 200:
                    continue
                f.write(json.dumps({"text": text}) + "\n")
                total += len(text); files += 1
print(f"corpus: {files} .py files, {total / 1e6:.1f} MB of text from {len(roots)} roots")
PY
  $PY tools/preprocess_data.py --input "$WORK/corpus.jsonl" --output-prefix "$WORK/corpus" \
    --tokenizer-type ByteLevelTokenizer --append-eod --workers 4 | tail -2
fi
[ "${CORPUS_ONLY:-0}" = 1 ] && { echo "corpus ready in $WORK ($(( SECONDS - T0 )) s)"; exit 0; }
COMMON="$MODEL --swiglu --normalization RMSNorm --position-embedding-type rope --untie-embeddings-and-output-weights
  --disable-bias-linear --hidden-dropout 0 --attention-dropout 0 --micro-batch-size $MB --global-batch-size $GBS
  --train-iters $ITERS --lr 6e-4 --min-lr 6e-5 --lr-decay-style cosine --lr-warmup-iters $(( ITERS / 20 ))
  --adam-beta2 0.95 --weight-decay 0.1 --clip-grad 1.0 --bf16 --seed 1234 $DEVICE
  --tokenizer-type ByteLevelTokenizer --data-path $WORK/corpus_text_document --split 98,2,0 $EVAL
  --log-interval 50 --offload-tiers host --offload-subgroup-size 20000000"
run_variant() {  # $1: variant, $2: port
  local variant=$1 flags started rc
  case $variant in
    fp32) flags="";;
    bf16) flags="--use-precision-aware-optimizer --exp-avg-dtype bf16 --exp-avg-sq-dtype bf16";;
    fp8) flags="--use-precision-aware-optimizer --exp-avg-dtype fp8 --exp-avg-sq-dtype fp8";;
    *) echo "error: VARIANTS='$VARIANTS': each one of fp32, bf16, fp8"; return 2;;
  esac
  started=$SECONDS
  : > "$OUT/converge_$variant.log"
  if [ "${CHAIN:-0}" = 1 ]; then
    flags="$flags --save $WORK/ckpt_$variant --load $WORK/ckpt_$variant
      --exit-duration-in-mins $(python3 -c "print(max(0.5, (${LIMIT:-280} - 60) / 60))")"
    # the logs so far (the device tool empties OUT before each call; WORK stays while the machine is warm)
    cp "$WORK/converge_$variant.jsonl" "$WORK/converge_$variant.log" "$OUT/" 2>/dev/null
  fi
  # shellcheck disable=SC2086
  timeout "${LIMIT:-280}" torchrun --nproc_per_node $NPROC --master_port "$2" pretrain_gpt.py $COMMON $flags \
    --loss-log "$OUT/converge_$variant.jsonl" >> "$OUT/converge_$variant.log" 2>&1
  rc=$?
  [ "${CHAIN:-0}" = 1 ] && cp "$OUT/converge_$variant.jsonl" "$OUT/converge_$variant.log" "$WORK/"
  echo "$variant: exit $rc in $(( SECONDS - started )) s"
  grep -E "offload rank 0:.*bytes|^error|Error:" "$OUT/converge_$variant.log" | grep -v -i warn | head -5 | cut -c1-300
  grep -E "validation loss at iteration" "$OUT/converge_$variant.log" | cut -c1-120 | tail -3
}
# PARALLEL=1: the variants at once on the one GPU (a 129 M model leaves it mostly idle: 0.25 s a step
# at ~10% of its FLOP/s, H200, 2026-11-27), each its own process and port.
port=${PORT:-29561}
for variant in ${VARIANTS:-fp32 bf16 fp8}; do
  if [ "${PARALLEL:-0}" = 1 ]; then run_variant "$variant" "$port" & else run_variant "$variant" "$port"; fi
  port=$(( port + 1 ))
done
wait
$PY benchmarks/plot_convergence.py "$OUT" ${VARIANTS:-fp32 bf16 fp8} | tee "$OUT/converge_summary.txt"
echo "converge_moments.sh: $(( SECONDS - T0 )) s"
