"""tools/setup_env.sh where python3 is itself a virtual environment holding torch (a common cluster
set-up): the new .venv uses that torch and installs nothing, so it works offline."""

import subprocess
import sys

import pytest

from launch import REPO


def _offline_env(tmp_path):
    """python3 is this venv; an empty wheelhouse and no index: any download would fail."""
    wheelhouse = tmp_path / "wheels"
    wheelhouse.mkdir()
    return {"PATH": "/usr/bin:/bin", "HOME": str(tmp_path), "MLP_OFFLOAD_PYTHON": sys.executable,
            "MLP_OFFLOAD_VENV": str(tmp_path / "venv"), "MLP_OFFLOAD_WHEELHOUSE": str(wheelhouse),
            "PIP_NO_INDEX": "1", "PIP_CONFIG_FILE": "/dev/null"}


@pytest.mark.skipif(sys.prefix == sys.base_prefix, reason="needs the tests to run inside a virtual environment")
def test_venv_from_a_venv_uses_its_torch_offline_and_skips_a_missing_optional_package(tmp_path):
    """One set-up (a venv costs ~25 s here) checks both: the starting environment's torch is used and
    nothing is installed; and, the issue's case, one optional wheel absent from the wheelhouse (pip
    would install nothing of a call holding it): the set-up goes on, says what it skipped, and the
    repo imports."""
    import torch

    env = {**_offline_env(tmp_path), "MLP_OFFLOAD_OPTIONAL": "absent-package==0.31.0:absent_package numpy:numpy"}
    wheelhouse = env["MLP_OFFLOAD_WHEELHOUSE"]
    done = subprocess.run(["bash", "-c", f"source {REPO}/tools/setup_env.sh && python -c "
                           "'import sys, torch, megatron.training.runtime.slurm_env as m; "
                           "import megatron.training.runtime.optional_packages; print(sys.prefix); "
                           "print(torch.__file__); print(m.__file__)'"],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "installing" not in done.stdout + done.stderr
    assert f"optional absent-package==0.31.0 not available in {wheelhouse}: skipped" in done.stdout
    assert "numpy" not in done.stdout  # present: not asked for
    prefix, torch_file, module = done.stdout.split()[-3:]
    assert prefix == str(tmp_path / "venv")
    assert torch_file == torch.__file__  # the starting environment's torch, not a second one
    assert module == str(REPO / "megatron" / "training" / "runtime" / "slurm_env.py")
