#!/usr/bin/env bash
# The test command: sets up .venv if needed, then runs the unit and the CPU integration tests.
# Arguments go to pytest; where they name test files or directories, only those run.
# MLP_OFFLOAD_TEST_PROFILE=thorough draws every example of the property tests (tests/profiles.py).
set -euo pipefail
REPO="$(cd "$(dirname "$0")/.." && pwd)"
cd "$REPO"
source tools/setup_env.sh
export MLP_OFFLOAD_TEST_PROFILE="${MLP_OFFLOAD_TEST_PROFILE:-ci}"
if [[ "$MLP_OFFLOAD_TEST_PROFILE" == thorough ]]; then
    export MLP_OFFLOAD_TEST_LAUNCHER="${MLP_OFFLOAD_TEST_LAUNCHER:-torchrun}"  # every launch as users launch
fi
# Test files spread over MLP_OFFLOAD_TEST_WORKERS processes (pytest-xdist; default 2, each file on one, so its
# module-wide runs start once); 1, or no pytest-xdist, runs them in this process.
if [[ ! "${MLP_OFFLOAD_TEST_WORKERS:-2}" =~ ^[1-9][0-9]*$ ]]; then
    echo "error: MLP_OFFLOAD_TEST_WORKERS=${MLP_OFFLOAD_TEST_WORKERS}: expected a positive integer" >&2
    exit 2
fi
workers=(-p no:xdist)
if [[ "${MLP_OFFLOAD_TEST_WORKERS:-2}" -gt 1 ]] && python -c "import xdist" 2>/dev/null; then
    workers=(-n "${MLP_OFFLOAD_TEST_WORKERS:-2}" --dist loadfile)
fi
paths=(tests/unit tests/integration)
for arg in "$@"; do
    if [[ "$arg" != -* && -e "${arg%%::*}" ]]; then
        paths=()
        break
    fi
done
python -m pytest -q -p no:cacheprovider --durations=20 "${workers[@]}" "${paths[@]}" "$@"
