# Source me: creates (once) and activates .venv with what the project needs.
# CPU machines get the pinned CPU build of torch (an unpinned torch pulls GBs of CUDA wheels);
# machines that already have a torch (e.g. a GPU image) keep theirs through system site-packages.
set -e
REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="${MLP_OFFLOAD_VENV:-$REPO/.venv}"
if [ ! -x "$VENV/bin/python" ]; then
    python3 -m venv --system-site-packages "$VENV"
fi
# shellcheck disable=SC1091
source "$VENV/bin/activate"
need=()
python -c "import torch" 2>/dev/null || need+=("torch==2.13.0")
python -c "import megatron.core" 2>/dev/null || need+=("megatron-core==0.16.1")
for spec in numpy pytest psutil hypothesis==6.155.2; do  # pip requirements, imported by the name before any ==
    python -c "import ${spec%%==*}" 2>/dev/null || need+=("$spec")
done
if [ ${#need[@]} -gt 0 ]; then
    echo "setup_env: installing ${need[*]}"
    python -m pip install -q "${need[@]}"
fi
python -m pip install -q --no-deps --no-build-isolation -e "$REPO" >/dev/null
export PYTHONWARNINGS="${PYTHONWARNINGS:-ignore}"
set +e
