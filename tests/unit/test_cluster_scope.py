"""What is per node, per job and per file system on a cluster: run ids per job step."""

import pytest

from mlp_offload.config import OffloadConfig


def test_two_steps_of_one_allocation_get_their_own_namespaces(monkeypatch):
    monkeypatch.delenv("MLP_OFFLOAD_RUN_ID", raising=False)
    monkeypatch.setenv("SLURM_JOB_ID", "777")
    ids = []
    for step in ("0", "1"):
        monkeypatch.setenv("SLURM_STEP_ID", step)
        ids.append(OffloadConfig().resolved_run_id())
    monkeypatch.delenv("SLURM_STEP_ID")
    ids.append(OffloadConfig().resolved_run_id())  # python run by the batch script itself
    assert ids == ["777.0", "777.1", "777.batch"]
