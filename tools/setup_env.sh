# Source me: creates (once) and activates .venv with what the project needs, installing only what is
# missing.
# torch: the one importable where you start is used as it is, wherever it lives: a virtual
# environment (the usual cluster set-up: python3 is itself a venv with a CUDA torch), a conda
# environment, a module's PYTHONPATH, the system. Only a machine with no torch at all gets one: the
# pinned CPU build (an unpinned torch pulls GBs of CUDA wheels). pip is never allowed to replace it.
# Nodes without internet: MLP_OFFLOAD_WHEELHOUSE=DIR installs from a directory of wheels only
# (fill it elsewhere: pip download --no-deps -d DIR megatron-core==0.16.1 numpy packaging pytest
# iniconfig pluggy psutil, plus any of the optional ones below with their dependencies: each optional
# one missing from DIR is skipped with a note).
# MLP_OFFLOAD_PYTHON picks the interpreter (default python3), MLP_OFFLOAD_VENV the venv's place.
set -e
REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="${MLP_OFFLOAD_VENV:-$REPO/.venv}"
BASE_PYTHON="${MLP_OFFLOAD_PYTHON:-python3}"
if [ ! -x "$VENV/bin/python" ]; then
    "$BASE_PYTHON" -m venv --system-site-packages "$VENV"
fi
# A venv made from inside another venv sees the base interpreter's packages, not that venv's: point
# it at the directories where the starting interpreter finds torch (and the rest of its packages).
purelib="$("$VENV/bin/python" -c "import sysconfig; print(sysconfig.get_paths()['purelib'])")"
if ! "$VENV/bin/python" -c "import torch" 2>/dev/null && "$BASE_PYTHON" -c "import torch" 2>/dev/null; then
    "$BASE_PYTHON" -c "
import os, site, torch
dirs = [os.path.dirname(os.path.dirname(torch.__file__))] + site.getsitepackages()
print('\n'.join(dict.fromkeys(dirs)))" >"$purelib/_mlp_offload_outer_env.pth"
fi
# shellcheck disable=SC1091
source "$VENV/bin/activate"
pip_args=(-q)
if [ -n "${MLP_OFFLOAD_WHEELHOUSE:-}" ]; then
    pip_args+=(--no-index --find-links "$MLP_OFFLOAD_WHEELHOUSE")
fi
need=()
if torch_version="$(python -c "import torch; print(torch.__version__)" 2>/dev/null)"; then
    # megatron-core asks for torch>=2.6: never let pip fetch another torch over the user's.
    printf 'torch==%s\n' "$torch_version" >"$VENV/torch-constraint.txt"
    pip_args+=(-c "$VENV/torch-constraint.txt")
else
    need+=("torch==2.13.0")
fi
python -c "import megatron.core" 2>/dev/null || need+=("megatron-core==0.16.1")
# Offline beside a torch that is already there, pip would check torch's own requirements against this
# venv (Python 3.11's venv brings setuptools 65; torch 2.13 asks for >= 77.0.3, which the outer
# environment has but this venv shadows) and stop asking the wheelhouse for them. The wheelhouse recipe
# names every package the project needs, so install exactly those without resolving, then check.
no_deps=()
required="numpy psutil pytest"
if [ -n "${MLP_OFFLOAD_WHEELHOUSE:-}" ] && [ -n "${torch_version:-}" ]; then
    no_deps=(--no-deps)
    required="numpy psutil pytest packaging iniconfig pluggy"
fi
# Required: REQUIREMENT[:IMPORT_NAME], installed together (online, pytest brings its plugins).
for spec in $required; do
    python -c "import ${spec#*:}" 2>/dev/null || need+=("${spec%%:*}")
done
if [ ${#need[@]} -gt 0 ]; then
    echo "setup_env: installing ${need[*]}${MLP_OFFLOAD_WHEELHOUSE:+ from $MLP_OFFLOAD_WHEELHOUSE}"
    python -m pip install "${pip_args[@]}" "${no_deps[@]}" "${need[@]}"
fi
missing=""
for module in megatron.core numpy psutil pytest; do
    python -c "import $module" 2>/dev/null || missing="$missing $module"
done
if [ -n "$missing" ]; then
    echo "setup_env: still not importable after the install:$missing${MLP_OFFLOAD_WHEELHOUSE:+ (is its wheel, with its dependencies, in $MLP_OFFLOAD_WHEELHOUSE?)}" >&2
    return 1 2>/dev/null || exit 1
fi
# Optional, each on its own where it can be had (pip installs nothing at all when one package of a
# call is missing, so one absent wheel must not cost the others): hypothesis and pytest-xdist (with execnet;
# tests/run.sh spreads the files over two processes) for the tests;
# matplotlib draws --offload-trace files; tensorboard and wandb (offline) receive the metrics;
# tokenizers, sentencepiece, tiktoken and transformers (GPT-2 and HuggingFace files, read offline)
# are what megatron.core.tokenizers reads users' tokenizer files with. transformers 5.23 goes with
# tokenizers 0.23 (the 4.x releases want tokenizers<=0.23.0 and huggingface-hub<1) and needs no
# torch. A flag that needs a missing one says so in one line (megatron/training/runtime/optional_packages.py).
# MLP_OFFLOAD_OPTIONAL replaces the list (e.g. empty: none).
optional="${MLP_OFFLOAD_OPTIONAL-hypothesis==6.155.2:hypothesis pytest-xdist==3.8.0:xdist \
    matplotlib==3.10.3:matplotlib \
    tensorboard==2.21.0:tensorboard wandb==0.31.0:wandb tokenizers==0.23.3:tokenizers \
    sentencepiece==0.2.3:sentencepiece tiktoken==0.14.0:tiktoken transformers==5.23.0:transformers}"
for spec in $optional; do
    python -c "import ${spec#*:}" 2>/dev/null && continue
    if python -m pip install "${pip_args[@]}" "${spec%%:*}" >/dev/null 2>&1; then
        echo "setup_env: installed optional ${spec%%:*}"
    else
        echo "setup_env: optional ${spec%%:*} not available${MLP_OFFLOAD_WHEELHOUSE:+ in $MLP_OFFLOAD_WHEELHOUSE}: skipped (flags that need it will say so)"
    fi
done
# The repo itself on the venv's path (what an editable install does, without needing a build
# backend, so offline too).
echo "$REPO" >"$purelib/_mlp_offload_repo.pth"
export PYTHONWARNINGS="${PYTHONWARNINGS:-ignore}"
set +e
