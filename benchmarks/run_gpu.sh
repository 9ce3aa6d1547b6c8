#!/usr/bin/env bash
# The one GPU runner: installs the carried wheels once, then runs a named experiment.
#   bash benchmarks/run_gpu.sh NAME [args...]     runs benchmarks/experiments/NAME.sh with args
#   bash benchmarks/run_gpu.sh                    lists the experiments
# From the repo root on the GPU machine, with the wheels (megatron-core; deepspeed and its deps for the
# peers in .whl/peers/, installed by peer_env.sh alone) carried in .whl/ (the device tool's carry list:
# [".whl"], plus ".deb" for the peers' libaio and what an experiment's header names). Results go to $OUT
# (default /tmp/out). Getting them, where pip and apt reach an index: `bash tools/fetch_device_wheels.sh`
# fills .whl/ (megatron-core), .whl/peers/ (deepspeed built with DS_BUILD_OPS=0, its dependencies' cp312
# wheels) and .deb/ (libaio), skipping what is there, and prints the size to carry.
set -u
cd "$(dirname "$0")/.."
if [ $# -lt 1 ]; then
    echo "usage: bash benchmarks/run_gpu.sh NAME [args...]; NAME is one of:"
    for f in benchmarks/experiments/*.sh; do
        case "$(basename "$f")" in peer_env.sh|upstream_flags.sh|memory_watch.sh|timestamps.sh|iteration_lines.sh|run_summary.sh) continue ;; esac
        printf '  %-22s %s\n' "$(basename "$f" .sh)" "$(sed -n 2p "$f" | sed 's/^# *//')"
    done
    exit 2
fi
NAME=$1; shift
SCRIPT=benchmarks/experiments/$NAME.sh
[ -f "$SCRIPT" ] || { echo "no experiment $NAME (benchmarks/experiments/$NAME.sh)"; exit 2; }
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
if [ ! -f /tmp/site/.installed ]; then
    # As a user's install: byte-compiled (a first import of uncompiled megatron-core added seconds to
    # every start-up measured), and the CPU one-pass kernel built once (cached per CPU model, as a
    # cluster's shared home keeps it; a node's first-ever run builds it in ~20 s).
    python3 -m pip install -q --no-index --no-deps --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
    started=$(date +%s)
    python3 -c "from mlp_offload.kernels.cpu_one_pass import extension, build_error
print('CPU one-pass kernel:', 'built' if extension() is not None else build_error())"
    echo "install: CPU kernel build $(( $(date +%s) - started )) s"
    touch /tmp/site/.installed
fi
export OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
exec bash "$SCRIPT" "$@"
