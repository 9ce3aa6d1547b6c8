"""A real file system of a few megabytes (a tmpfs) for the disk-full and read-only tests.

Mounting needs root. CI runs as root (``.ci/run`` sets MLP_OFFLOAD_CI=1), so there a failed mount
fails the test: these tests must not turn into skips where they are meant to run. Elsewhere they
skip with a line saying why.
"""

import contextlib
import os
import subprocess

import pytest

IN_CI = os.environ.get("MLP_OFFLOAD_CI") == "1"


@contextlib.contextmanager
def small_file_system(path, size: str):
    """``path`` (created if missing) as a tmpfs of ``size`` (mount's syntax: ``5m``), unmounted after."""
    os.makedirs(path, exist_ok=True)
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)],
                             capture_output=True, text=True)
    if mounted.returncode != 0:
        why = f"cannot mount a {size} tmpfs at {path}: {mounted.stderr.strip() or 'mount failed'}"
        if IN_CI:
            pytest.fail(f"{why}; CI runs as root and must run this test")
        pytest.skip(f"{why} (needs root; CI runs this test as root)")
    try:
        yield path
    finally:
        subprocess.run(["umount", "-l", str(path)], check=False)
