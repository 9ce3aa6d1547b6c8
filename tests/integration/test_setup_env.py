"""tools/setup_env.sh where python3 is itself a virtual environment holding torch (a common cluster
set-up): the new .venv uses that torch and installs nothing, so it works offline."""

import subprocess
import sys

import pytest

from launch import REPO


@pytest.mark.skipif(sys.prefix == sys.base_prefix, reason="needs the tests to run inside a virtual environment")
def test_venv_from_a_venv_uses_its_torch_offline(tmp_path):
    import torch

    wheelhouse = tmp_path / "wheels"
    wheelhouse.mkdir()
    env = {"PATH": "/usr/bin:/bin", "HOME": str(tmp_path), "MLP_OFFLOAD_PYTHON": sys.executable,
           "MLP_OFFLOAD_VENV": str(tmp_path / "venv"), "MLP_OFFLOAD_WHEELHOUSE": str(wheelhouse),
           "PIP_NO_INDEX": "1", "PIP_CONFIG_FILE": "/dev/null"}  # offline: any download would fail
    done = subprocess.run(["bash", "-c", f"source {REPO}/tools/setup_env.sh && python -c "
                           "'import sys, torch, megatron.training.runtime.slurm_env as m; print(sys.prefix); "
                           "print(torch.__file__); print(m.__file__)'"],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "installing" not in done.stdout + done.stderr
    prefix, torch_file, module = done.stdout.split()[-3:]
    assert prefix == str(tmp_path / "venv")
    assert torch_file == torch.__file__  # the starting environment's torch, not a second one
    assert module == str(REPO / "megatron" / "training" / "slurm_env.py")
