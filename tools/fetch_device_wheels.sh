#!/usr/bin/env bash
# Fills the wheelhouse the GPU experiments carry to the GPU machine (no internet there; Python 3.12,
# x86_64, torch preinstalled, no libaio). Run it here, where pip reaches PyPI and apt reaches Debian:
#   bash tools/fetch_device_wheels.sh          (from anywhere; about 20 s the first time, ~1 s after)
# It makes, under the repo root (both ignored by git):
#   .whl/megatron_core-0.16.1-cp312-*.whl    what every experiment installs (benchmarks/run_gpu.sh)
#   .whl/peers/*.whl                         DeepSpeed 0.19.8 built here with DS_BUILD_OPS=0 (ops JIT-built
#                                            there), and its runtime dependencies for cp312 manylinux
#                                            (installed by benchmarks/experiments/peer_env.sh alone)
#   .deb/libaio*.deb                         libaio and its headers, for DeepSpeed's async_io JIT op
# A device call takes them with its carry list [".whl", ".deb"] (64 MiB at most, all carried paths
# together: the script stops if .whl passes 60 MiB). Whatever is already there is kept: a re-run fetches only what is
# missing, and needs no network when nothing is.
# Not fetched: torch and nvidia-* CUDA wheels (the image has them), and numpy (megatron-core needs it and
# run_gpu.sh installs megatron-core with --no-deps, so the image has it; a second numpy in /tmp/site would
# shadow the image's).
# PYTHON=... picks the interpreter that builds DeepSpeed (it needs torch importable); default: the repo's
# .venv (made by tools/setup_env.sh if missing).
set -euo pipefail
REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$REPO"
say() { echo "fetch_device_wheels: $*"; }
die() { echo "fetch_device_wheels: $*" >&2; exit 1; }

MEGATRON_CORE=0.16.1
DEEPSPEED=0.19.8
# DeepSpeed 0.19.8's requirements (einops hjson msgpack ninja numpy packaging psutil py-cpuinfo pydantic
# torch tqdm, plus nvidia-ml-py for CUDA builds) less torch and numpy, with pydantic's own dependencies,
# pinned to the versions pip resolved for cp312 when this list was written.
PEER_DEPS="einops==0.8.2 hjson==3.1.0 msgpack==1.2.4 ninja==1.13.2 packaging==26.4 psutil==7.2.2
py-cpuinfo==9.0.0 pydantic==2.14.4 pydantic-core==2.50.5 annotated-types==0.8.0 typing-inspection==0.4.5
typing-extensions==4.16.0 tqdm==4.70.1 nvidia-ml-py==13.615.71"
TARGET=(--only-binary=:all: --python-version 3.12 --implementation cp --abi cp312
        --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64)
WHL_LIMIT_MIB=60

if [ -n "${PYTHON:-}" ]; then
    PY=$PYTHON
elif [ -x .venv/bin/python ]; then
    PY=.venv/bin/python
else
    say "no .venv: making it with tools/setup_env.sh"
    bash -c 'source tools/setup_env.sh' || die "tools/setup_env.sh failed"
    PY=.venv/bin/python
fi

# wheel_present NAME VERSION: a wheel of it is in the directory $2 (names normalised as in wheel files).
wheel_present() {
    local stem
    stem="$(echo "$1" | tr 'A-Z' 'a-z' | sed 's/[-.]/_/g')-$2-"
    compgen -G "$3/$stem*.whl" >/dev/null
}
pypi_checked=0
need_pypi() {
    [ $pypi_checked = 1 ] && return 0
    "$PY" -c "import urllib.request; urllib.request.urlopen('https://pypi.org/simple/pip/', timeout=20)" 2>/dev/null \
        || die "cannot reach https://pypi.org (needed for: $1); run this where pip reaches PyPI"
    pypi_checked=1
}

# 1. megatron-core.
mkdir -p .whl/peers
if compgen -G ".whl/megatron_core-$MEGATRON_CORE-cp312-*.whl" >/dev/null; then
    say "megatron-core $MEGATRON_CORE: already there"
else
    need_pypi "megatron-core $MEGATRON_CORE"
    "$PY" -m pip download -q --no-deps "${TARGET[@]}" -d .whl "megatron-core==$MEGATRON_CORE"
fi

# 2. DeepSpeed, built from its sdist against the torch of $PY (setup.py imports it) without isolation (an
# isolated build has no torch); DS_ACCELERATOR=cuda records the GPU machine's accelerator, not this one's.
if wheel_present deepspeed "$DEEPSPEED" .whl/peers; then
    say "deepspeed $DEEPSPEED: already there"
else
    "$PY" -c "import torch, setuptools, wheel" 2>/dev/null \
        || die "$PY cannot import torch, setuptools and wheel, which DeepSpeed's build needs (source tools/setup_env.sh, or PYTHON=...)"
    need_pypi "deepspeed $DEEPSPEED"
    say "building deepspeed $DEEPSPEED (DS_BUILD_OPS=0)"
    DS_BUILD_OPS=0 DS_ACCELERATOR=cuda "$PY" -m pip wheel -q --no-deps --no-build-isolation --no-cache-dir \
        --no-binary deepspeed -w .whl/peers "deepspeed==$DEEPSPEED"
    wheel_present deepspeed "$DEEPSPEED" .whl/peers || die "pip built no deepspeed-$DEEPSPEED wheel"
fi

# 3. DeepSpeed's dependencies, as cp312 manylinux (or pure-python) wheels.
missing=()
for spec in $PEER_DEPS; do
    wheel_present "${spec%%==*}" "${spec#*==}" .whl/peers || missing+=("$spec")
done
if [ ${#missing[@]} -gt 0 ]; then
    need_pypi "${missing[*]}"
    "$PY" -m pip download -q --no-deps "${TARGET[@]}" -d .whl/peers "${missing[@]}"
else
    say "deepspeed's dependencies: already there"
fi
for f in .whl/peers/*.whl; do
    case "$(basename "$f")" in
        nvidia_ml_py-*) ;;
        torch-*|triton-*|nvidia_*|numpy-*) die "$f would shadow the GPU image's own: remove it" ;;
    esac
done

# 4. libaio for DeepSpeed's async_io op: unpacked there by peer_env.sh (dpkg -x), never installed.
mkdir -p .deb
if compgen -G ".deb/libaio1*.deb" >/dev/null && compgen -G ".deb/libaio-dev_*.deb" >/dev/null; then
    say "libaio .debs: already there"
else
    # libaio1t64 on Debian 13 and later, libaio1 before.
    libaio_name() {
        local name
        for name in libaio1t64 libaio1; do
            case "$(apt-cache policy "$name" 2>/dev/null)" in *"Candidate: "[0-9]*) echo "$name"; return ;; esac
        done
    }
    aio=$(libaio_name)
    if [ -z "$aio" ]; then
        say "no libaio in apt's lists: apt-get update"
        apt-get update -qq || die "apt-get update failed (is Debian's archive reachable?)"
        aio=$(libaio_name)
    fi
    [ -n "$aio" ] || die "apt knows neither libaio1t64 nor libaio1"
    sandbox=(); [ "$(id -u)" = 0 ] && sandbox=(-o APT::Sandbox::User=root)   # else apt warns about _apt
    (cd .deb && apt-get download -qq "${sandbox[@]}" "$aio" libaio-dev) \
        || die "apt-get download $aio libaio-dev failed (is Debian's archive reachable?)"
fi

# Sizes: the device call carries 64 MiB at most, every carried path together.
ls -l .whl/*.whl .whl/peers/*.whl .deb/*.deb | awk '{printf "  %9d  %s\n", $5, $NF}'
whl_bytes=$(du -sb .whl | cut -f1)
deb_bytes=$(du -sb .deb | cut -f1)
awk -v w="$whl_bytes" -v d="$deb_bytes" 'BEGIN {
    printf "fetch_device_wheels: .whl %.1f MiB (all under it), .deb %.2f MiB, together %.1f MiB\n",
        w / 1048576, d / 1048576, (w + d) / 1048576 }'
[ "$whl_bytes" -le $((WHL_LIMIT_MIB * 1048576)) ] \
    || die ".whl is over $WHL_LIMIT_MIB MiB: the device call carries 64 MiB at most"
