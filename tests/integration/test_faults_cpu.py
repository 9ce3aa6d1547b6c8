"""Crash consistency with offload (2 CPU processes): a rank SIGKILLs itself at an injected point
(mlp_offload.faults), then the same command is run again. It must resume from the last complete
checkpoint and continue exactly as a run that never stopped; the dead run's swap files are
reported, never reused, and tools/offload_clean.py removes them. No process of the dead rank may
outlive it (run_pretrain fails on survivors): the checkpoint writer's Manager, started before the
first save, and its forked writers die with it."""

import subprocess
import sys

import pytest

from conftest import BASELINE_ITERS as ITERS
from launch import REPO, run_pretrain, tool_module
from helpers import offload_args
from tests.profiles import cases

# point -> the iteration the restart must resume after (checkpoints every 2 iterations).
CASES = {
    "forward@1#7": 2,       # 2 micro-batches per iteration and rank: dies starting iteration 4
    "backward@0#6": 2,      # dies in the backward of iteration 3
    "update@1#3": 2,        # dies half-way through the update of iteration 3; rank 0, SIGTERMed by
                            # torchrun maybe inside a collective that never returns, removes its swap files
    "save-offload@0#2": 0,  # dies while streaming its state into the first checkpoint
    "fork@1#1": 0,          # dies in the first checkpoint, its writer process just forked
    "save-complete@0#1": 0,  # every file written, the completeness proof not yet: incomplete
    "save-tracker@0#1": 2,  # proven complete, the tracker not yet updated: found by its proof
    "save-tracker@1#1": 2,  # rank 0 still records it: the checkpoint is complete
}


@pytest.fixture(scope="module")
def uninterrupted(offload_baseline):
    """The same offloaded run, never stopped (conftest.offload_baseline)."""
    return offload_baseline


# Each case is two launches: CI runs half of them, drawn by a seed that every failure prints
# (tests/profiles.py). The first case's crashed run goes through torchrun, as users launch; the
# others' through the warm launcher, which stops the other rank as torchrun does (SIGTERM, SIGKILL
# 30 s later) in a third of the time. The thorough profile sends every launch through torchrun.
FAULTS = cases(CASES, ci_keep=4)


@pytest.mark.parametrize("fault", FAULTS)
def test_kill_and_restart_resumes_exactly(tmp_path, uninterrupted, fault):
    args = [*offload_args(tmp_path), "--save", str(tmp_path / "ckpt"), "--load", str(tmp_path / "ckpt"),
            "--save-interval", "2"]
    crashed = run_pretrain(tmp_path, args, train_iters=ITERS, env={"MLP_OFFLOAD_FAULT": fault},
                           loss_log=tmp_path / "crashed.jsonl", expect_success=False, torchrun=fault == FAULTS[0])
    assert crashed[0]["returncode"] != 0, "the injected fault did not stop the run"
    # The survivor, stopped by the launcher's SIGTERM wherever it was (a collective, mid-I/O), removed
    # its swap files; only the SIGKILLed rank's are left.
    killed = fault.split("@")[1].split("#")[0]
    for tier in ("nvme", "pfs"):
        left = sorted(p.name for p in (tmp_path / tier).glob("mlp_offload/*/rank*"))
        assert left == [f"rank{int(killed):05d}"], (tier, left, crashed[0]["output"][-2000:])
    resumed = run_pretrain(tmp_path, args, train_iters=ITERS, loss_log=tmp_path / "resumed.jsonl")
    start = CASES[fault]
    assert [r["iteration"] for r in resumed] == list(range(start + 1, ITERS + 1))
    assert resumed == uninterrupted[start:]
    output = (tmp_path / "resumed.out").read_text()
    assert "stale offload namespace(s) of dead runs" in output
    if fault.startswith(("save-offload", "save-complete", "fork")):
        assert f"removed incomplete checkpoint {tmp_path / 'ckpt' / 'iter_0000002'}" in output
    if fault == "save-tracker@0#1":
        assert f"resuming from {tmp_path / 'ckpt' / 'iter_0000002'}, the newest complete checkpoint" in output
    # The killed rank's files are left behind (SIGKILL): the cleaner finds and removes them.
    cleaner = [sys.executable, str(REPO / "tools" / "offload_clean.py"), str(tmp_path / "nvme"), str(tmp_path / "pfs")]
    listing = subprocess.run(cleaner, capture_output=True, text=True, check=True).stdout
    assert "dead" in listing
    tool_module("offload_clean").main([*cleaner[2:], "--delete"])  # in this process: the command line ran just above
    leftovers = [p for d in ("nvme", "pfs") for p in (tmp_path / d).rglob("*.state")]
    assert leftovers == []
