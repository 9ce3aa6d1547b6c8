#!/usr/bin/env bash
# 25.36 B with fp8 moments on one H200: the default gpu margin with NCCL allocation logging, then margin 8 GiB if it failed.
#   bash benchmarks/run_gpu.sh nccl_margin_25b   (device tool, kind nvidia-h200, carry [".whl"]; ~330 s)
# LIMIT4 (default 160 s; 115 s was too short on a fresh machine, 2026-11-28) bounds the first run.
export OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"; FP8="--use-precision-aware-optimizer --exp-avg-dtype fp8 --exp-avg-sq-dtype fp8"
r() { OUT=$OUT/$1 DISK=/var/tmp/o_$1 HOST_GB=97 PREC="$FP8" LAYERS=${L:-64} ITERS=8 LIMIT_S=$2 EXTRA="$3" bash benchmarks/experiments/largest_model.sh > $OUT/$1.console 2>&1; grep -c "iteration " $OUT/$1/largest.log 2>/dev/null || echo 0; }
n=$(NCCL_DEBUG=INFO NCCL_DEBUG_SUBSYS=INIT,ALLOC r 25b_margin4 ${LIMIT4:-160} ""); echo "margin 4: $n iteration lines"
[ "$n" -lt 8 ] && { n=$(r 25b_margin8 165 "--offload-gpu-margin-gb 8"); echo "margin 8: $n iteration lines"; }
for d in $OUT/25b_*/; do echo "== $d"; python3 benchmarks/experiments/iteration_summary.py $d/largest.log; grep -E "offload rank 0:|gpu tier auto" $d/largest.log | cut -c1-400; tail -3 $d/largest_peaks.txt; done
tail -25 $OUT/25b_margin4/nccl.txt 2>/dev/null
cd $OUT && tar czf /tmp/r25.tgz 25b_* && rm -rf 25b_*/ && mv /tmp/r25.tgz .
