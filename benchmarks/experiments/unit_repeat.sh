#!/usr/bin/env bash
# Unit tests on the device, repeated: whether a failure of the GPU suite's unit part comes back, with its tracebacks.
#   TESTS="tests/unit/test_async_save_host_params.py" REPEAT=3 bash benchmarks/run_gpu.sh unit_repeat
#   (kind nvidia-h200, carry [".whl"]); each run's whole log goes to $OUT/unit_repeat[_TAG]_K.log, a line per run
#   to $OUT/unit_repeat[_TAG].txt (TAG=name: two sets in one call, each under its own name; $OUT is the folder the
#   device returns, so keep it). ALONG="tests/unit/a.py ...": files run before TESTS in the same process, as the
#   suite orders them (state one test leaves, such as a host range still registered with CUDA, reaches the next).
set -u
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
export PYTHONWARNINGS=ignore
TESTS=${TESTS:?TESTS names the test files or node ids}
REPEAT=${REPEAT:-3}
NAME=unit_repeat${TAG:+_$TAG}
: > "$OUT/$NAME.txt"
for k in $(seq 1 "$REPEAT"); do
    # shellcheck disable=SC2086
    python3 -m pytest -p no:cacheprovider -W ignore -rfE --tb=long ${ALONG:-} $TESTS > "$OUT/${NAME}_$k.log" 2>&1
    echo "run $k exit $?: $(grep -E ' (passed|failed)' "$OUT/${NAME}_$k.log" | tail -1)" | tee -a "$OUT/$NAME.txt"
    grep -E '^(FAILED|ERROR) ' "$OUT/${NAME}_$k.log" | tee -a "$OUT/$NAME.txt"
done
