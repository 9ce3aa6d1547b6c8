#!/usr/bin/env bash
# The test command: sets up .venv if needed, then runs the unit and the CPU integration tests.
set -euo pipefail
REPO="$(cd "$(dirname "$0")/.." && pwd)"
cd "$REPO"
source tools/setup_env.sh
python -m pytest -q -p no:cacheprovider tests/unit tests/integration "$@"
