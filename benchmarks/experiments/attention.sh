#!/usr/bin/env bash
# Attention without transformer-engine (issue 28): megatron-core's unfused attention vs torch's SDPA, 10.24 B Llama.
#   The README's 10.24 B command (gpu_update.sh PART=b: gpu,host,nvme, --offload-gpu-cache-gb auto, host 74 GiB,
#   bf16 moments) at --seq-length 2048 and 8192, once with --attention-backend local (megatron-core's unfused
#   DotProductAttention: the full score matrix) and once with flash (torch's scaled_dot_product_attention), with
#   --log-throughput: iteration time, TFLOP/s, the peak the gpu tier saw ("gpu tier auto: peak ..." lines) and
#   nvidia-smi's peak (memory_peaks.txt). With auto the gpu tier fills what attention leaves free, so the GPU
#   peaks are alike and the saving shows as subgroups held in HBM; GPU_CACHE=40 fixes the tier instead.
#   SEQS="2048 8192", KERNELS="unfused sdpa", ITERS_B, LIMIT_B (default 270 s a run) as gpu_update.sh.
#   The unfused attention at 8192 holds some 20-30 GB of scores and probabilities per layer: running out of
#   memory there is a result, not a failure of the script.
# Run: SEQS=2048 bash benchmarks/run_gpu.sh attention, then SEQS=8192 (one device call each keeps under its
#   10 minutes; device tool, carry [".whl"]); one H200.
#   First (UNIT=0 skips it) tests/unit/test_sdpa_attention.py runs on the GPU: SDPA against megatron-core's
#   unfused attention there (fp32 and bf16, GQA, masks, dropout), as on CPU in the suite.
# Dry run on a CPU machine: DRY_RUN=1 bash benchmarks/experiments/attention.sh (tiny shapes, sequences 64 and 128).
# Writes sdpa_unit_tests.txt, 10b_bf16_<kernel>_s<seq>.log, memory_peaks.txt and attention_summary.txt to
# $OUT; they belong in docs/results/attention_h200_<date>/.
set -u
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 PYTHONPATH=${PYTHONPATH:-$PWD}
PY=${PYTHON:-python3}
if [ "${DRY_RUN:-0}" = 1 ]; then SEQS=${SEQS:-64 128}; else SEQS=${SEQS:-2048 8192}; fi
if [ "${UNIT:-1}" = 1 ]; then  # the module against megatron-core's unfused attention, on this machine's GPU
  device=$($PY -c 'import torch; print(torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu")')
  echo "== tests/unit/test_sdpa_attention.py on $device"
  $PY -m pytest -q -p no:cacheprovider -W ignore tests/unit/test_sdpa_attention.py 2>&1 | tail -3 | tee "$OUT/sdpa_unit_tests.txt"
fi
for seq in $SEQS; do
  for kernel in ${KERNELS:-unfused sdpa}; do
    backend=local; [ "$kernel" = sdpa ] && backend=flash
    echo "== $kernel at sequence $seq"
    PART=b STATES=bf16 LABEL="${kernel}_s$seq" LIMIT_B=${LIMIT_B:-270} \
      EXTRA="--attention-backend $backend --seq-length $seq --max-position-embeddings $seq --log-throughput" \
      bash benchmarks/experiments/gpu_update.sh > "$OUT/.attention_run.txt" 2>&1
    grep -E "exit|peak host" "$OUT/.attention_run.txt"
  done
done
$PY - "$OUT" $SEQS <<'PY' | tee "$OUT/attention_summary.txt"
import pathlib, re, statistics, sys
out, seqs = pathlib.Path(sys.argv[1]), sys.argv[2:]
print(f"{'seq':>6} {'attention':>9} {'iteration ms (median after the 1st)':>36} {'TFLOP/s/GPU':>12} {'gpu tier peak GiB':>18}"
      f"  gpu tier at the end")
for seq in seqs:
    for kernel in ("unfused", "sdpa"):
        log = out / f"10b_bf16_{kernel}_s{seq}.log"
        text = log.read_text() if log.exists() else ""
        ms = [float(x) for x in re.findall(r"elapsed time per iteration \(ms\): ([\d.]+)", text)][1:]
        tf = [float(x) for x in re.findall(r"TFLOP/s/GPU\): ([\d.]+)", text)][1:]
        peaks = [float(x) for x in re.findall(r"gpu tier auto: peak ([\d.]+) GiB", text)]
        held = re.findall(r"the gpu tier holds (\d+) \(([\d.]+) GiB\)", text)
        held = f"{held[-1][0]} subgroups, {held[-1][1]} GiB" if held else "unchanged"
        failed = "" if ms else "  (no iterations: see the log)"
        print(f"{seq:>6} {kernel:>9} {statistics.median(ms) if ms else float('nan'):>36.1f} "
              f"{statistics.median(tf) if tf else float('nan'):>12.1f} {max(peaks) if peaks else float('nan'):>18.2f}"
              f"  {held}{failed}")
# Same seed, data and flags (no dropout): the losses differ by the kernels' bf16 rounding only.
for seq in seqs:
    loss = {k: [float(x) for x in re.findall(r"lm loss: ([\d.E+-]+)", (out / f"10b_bf16_{k}_s{seq}.log").read_text())]
            if (out / f"10b_bf16_{k}_s{seq}.log").exists() else [] for k in ("unfused", "sdpa")}
    pairs = list(zip(loss["unfused"], loss["sdpa"]))
    rel = max((abs(s - u) / abs(u) for u, s in pairs), default=float("nan"))
    print(f"seq {seq}: losses unfused {loss['unfused']} sdpa {loss['sdpa']}: largest relative difference {rel:.2e}")
PY
rm -f "$OUT/.attention_run.txt"
