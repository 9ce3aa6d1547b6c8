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


def _wheel(wheelhouse, name, version, requires, files):
    """A minimal pure wheel (what pip installs from a wheelhouse), written by hand: no build backend
    and no index are needed."""
    import zipfile

    dist = f"{name.replace('-', '_')}-{version}"
    meta = "".join(f"Requires-Dist: {r}\n" for r in requires)
    contents = {**files,
                f"{dist}.dist-info/METADATA": f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n{meta}",
                f"{dist}.dist-info/WHEEL": "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n"}
    contents[f"{dist}.dist-info/RECORD"] = "".join(f"{path},,\n" for path in contents) + f"{dist}.dist-info/RECORD,,\n"
    with zipfile.ZipFile(wheelhouse / f"{dist}-py3-none-any.whl", "w") as whl:
        for path, text in contents.items():
            whl.writestr(path, text)


@pytest.mark.skipif(sys.prefix == sys.base_prefix, reason="needs the tests to run inside a virtual environment")
def test_offline_install_beside_a_venvs_torch_does_not_ask_the_wheelhouse_for_torchs_requirements(tmp_path):
    """The wheelhouse recipe of docs/user_guide.md ("Offline nodes") on a node whose python3 is a venv
    holding torch and its requirements (setuptools >= 77 among them) but not megatron-core: the new
    .venv (Python 3.11's venv brings its own setuptools 65) must install megatron-core from the
    wheelhouse alone. It stopped on 'Could not find a version that satisfies the requirement setuptools>=77.0.3 (from
    torch)'. Here megatron-core is a stand-in wheel with the real one's requirements."""
    import os

    import torch

    ours = os.path.dirname(os.path.dirname(torch.__file__))  # this venv's site-packages
    outer_site = tmp_path / "outer_site"  # everything of it but megatron-core
    outer_site.mkdir()
    for entry in os.listdir(ours):
        if not entry.startswith(("megatron", "_mlp_offload")) and not entry.endswith(".pth"):
            os.symlink(os.path.join(ours, entry), outer_site / entry)
    outer = tmp_path / "outer"
    subprocess.run([sys._base_executable, "-m", "venv", "--without-pip", str(outer)], check=True)
    outer_purelib = subprocess.run([str(outer / "bin" / "python"), "-c",
                                    "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                                   capture_output=True, text=True, check=True).stdout.strip()
    with open(os.path.join(outer_purelib, "outer_site.pth"), "w") as f:
        f.write(f"{outer_site}\n")
    env = {**_offline_env(tmp_path), "MLP_OFFLOAD_PYTHON": str(outer / "bin" / "python"), "MLP_OFFLOAD_OPTIONAL": ""}
    wheelhouse = tmp_path / "wheels"
    _wheel(wheelhouse, "megatron-core", "0.16.1", ["torch>=2.6.0", "numpy", "packaging>=24.2"],
           {"megatron/core/__init__.py": "STAND_IN = True\n"})
    done = subprocess.run(["bash", "-c", f"source {REPO}/tools/setup_env.sh && python -c "
                           "'import megatron.core as c, torch; print(c.STAND_IN, torch.__file__)'"],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "setup_env: installing megatron-core==0.16.1" in done.stdout
    stand_in, torch_file = done.stdout.split()[-2:]
    assert stand_in == "True" and torch_file == str(outer_site / "torch" / "__init__.py")
