"""Resource faults mid-run: disk full, a tier turned read-only, pinned memory refused.

Each gives an error that says what happened and what to change; the engine then refuses to step
(so no half-updated state is used), and nothing it already wrote is overwritten.
Disk-full and read-only use a real small tmpfs (tests/small_file_system.py: needs root; CI runs them as root).
"""

import contextlib
import errno
import os
import subprocess

import pytest
import torch

from mlp_offload import HostMemoryError, OffloadedAdamW, OffloadStateError
from mlp_offload.tiers import host as host_module

from tests.small_file_system import small_file_system

from .helpers import fast_config


def _engine(tmp_path, nvme):
    cfg = fast_config(tmp_path, tiers=["nvme"], subgroup_size=20_000, cache_alternating=False,
                      ranks_sharing_node=1)
    cfg.paths["nvme"] = str(nvme)
    return OffloadedAdamW(torch.randn(100_000), cfg)


def test_disk_full_during_flush(tmp_path):
    with small_file_system(tmp_path / "small", "4m") as nvme:
        eng = _engine(tmp_path, nvme)
        try:
            # Another job fills the disk after start-up (the placement check passed) and before
            # the state first lands there (rewriting an existing file in place needs no space).
            fd = os.open(nvme / "filler", os.O_WRONLY | os.O_CREAT)
            with contextlib.suppress(OSError):
                while True:
                    os.write(fd, b"\0" * (1 << 16))
            os.close(fd)
            eng.grad_buffer.normal_()
            with pytest.raises(OffloadStateError) as info:
                eng.step()
                eng.flush()
            msg = str(info.value)
            assert "No space left on device" in msg and "the file system is full" in msg
            assert "paths['nvme']" in msg  # what to change
            with pytest.raises(OffloadStateError, match="stopped after an earlier error"):
                eng.step()
        finally:
            eng.close()


def test_tier_turns_read_only(tmp_path):
    with small_file_system(tmp_path / "ro", "16m") as nvme:
        eng = _engine(tmp_path, nvme)
        try:
            eng.grad_buffer.normal_()
            eng.step()
            eng.flush()
            subprocess.run(["mount", "-o", "remount,ro", str(nvme)], check=True)
            eng.grad_buffer.normal_()
            with pytest.raises(OffloadStateError, match=r"Read-only file system.*use a writable paths\['nvme'\]"):
                eng.step()
                eng.flush()
        finally:
            subprocess.run(["mount", "-o", "remount,rw", str(nvme)], check=False)
            eng.close()


def test_pinned_memory_refused(tmp_path, monkeypatch):
    def refuse_pinning(self, raw):
        raise RuntimeError("cudaHostRegister failed with CUDA error 2")  # cudaErrorMemoryAllocation

    monkeypatch.setattr(host_module, "pinning_available", lambda: True)
    monkeypatch.setattr(host_module.HostMemory, "_register", refuse_pinning)
    cfg = fast_config(tmp_path, tiers=["host", "nvme"], subgroup_size=20_000, pin_memory=True,
                      host_budget_bytes=1 << 24)
    with pytest.raises(HostMemoryError, match=r"could not allocate .* GiB of pinned host memory .*"
                                              r"Lower host_budget_bytes, or raise the locked-memory limit"):
        OffloadedAdamW(torch.randn(100_000), cfg)
    # The failed start removed its directory.
    assert not (tmp_path / "nvme" / "mlp_offload").exists()


def test_error_hints_name_the_cause():
    from mlp_offload.tiers.files import FileTier

    tier = FileTier.__new__(FileTier)
    tier.name, tier.root = "pfs", "/"
    for code, hint in [(errno.EDQUOT, "quota"), (errno.EACCES, "writable paths['pfs']"),
                       (errno.ENOENT, "disappeared")]:
        err = tier.io_error("write", "/x", OSError(code, os.strerror(code)))
        assert hint in str(err)


def test_host_memory_checked_before_allocating(tmp_path, monkeypatch):
    monkeypatch.setattr(host_module, "_cgroup_limit_bytes", lambda: 64 << 20)
    cfg = fast_config(tmp_path, tiers=["host"], ranks_sharing_node=8)
    with pytest.raises(HostMemoryError, match=r"8 rank\(s\) of this node x 0.01 GiB \(optimizer cache 0.01, "
                                              r"gradient staging 0.00 GiB\) = 0.11 GiB, more than the 0.06 GiB of "
                                              r"this job's memory limit"):
        OffloadedAdamW(torch.randn(1_000_000), cfg)
