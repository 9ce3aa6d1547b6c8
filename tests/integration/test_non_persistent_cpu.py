"""--non-persistent-save-interval with --non-persistent-ckpt-type global (2 CPU processes, offload on): checkpoints
every 2 iterations into non_persistent/ inside --save, which keeps only its newest, beside the persistent ones every
3. A run killed once its non-persistent save at 4 is complete (the persistent newest at 3) resumes from 4, the later
one, and goes on exactly as the uninterrupted run; with background saves too."""

import pytest

from conftest import BASELINE_ITERS as ITERS
from launch import run_pretrain
from helpers import offload_args
from megatron.training.checkpoint import integrity

SAVES = ["--save-interval", "3", "--non-persistent-save-interval", "2", "--non-persistent-ckpt-type", "global"]
KILL_AFTER_THIRD_SAVE = {"MLP_OFFLOAD_FAULT": "save-tracker@0#3"}  # saves: non-persistent 2, persistent 3, non-p. 4


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_a_resume_takes_the_later_non_persistent_checkpoint_and_goes_on_exactly(tmp_path, mode, offload_baseline):
    ckpt = tmp_path / "ckpt"
    non_persistent = ckpt / integrity.NON_PERSISTENT_SUBDIR
    args = [*offload_args(tmp_path), "--save", str(ckpt), "--load", str(ckpt), *SAVES]
    if mode == "async":
        args.append("--async-save")
    run_pretrain(tmp_path, args, train_iters=ITERS, env=KILL_AFTER_THIRD_SAVE, loss_log=tmp_path / "killed.jsonl",
                 expect_success=False, torchrun=True)
    assert sorted(integrity.iteration_dirs(str(ckpt))) == [3]
    complete = [it for it, path in integrity.iteration_dirs(str(non_persistent)).items()
                if integrity.status(path).state == integrity.COMPLETE_STATE]
    assert max(complete) == 4, complete  # 2 may stay: killed between 4's tracker and the retirement that follows it
    resumed = run_pretrain(tmp_path, args, train_iters=ITERS, loss_log=tmp_path / "resumed.jsonl")
    out = (tmp_path / "resumed.out").read_text()
    assert f"resuming from the non-persistent checkpoint at iteration 4 in {non_persistent} (--load's newest is at 3)" \
        in out, out[-3000:]
    assert [r["iteration"] for r in resumed] == [5, 6]
    assert resumed == offload_baseline[4:]  # bit for bit: the losses and grad norms of the uninterrupted run
    # The end of training saved persistently (not also non-persistently at 6).
    assert sorted(integrity.iteration_dirs(str(ckpt))) == [3, 6]
    assert max(integrity.iteration_dirs(str(non_persistent))) == 4


def test_an_older_non_persistent_checkpoint_is_passed_over(tmp_path):
    """The persistent checkpoint at the end of training is later than the non-persistent one: a resume reads it."""
    ckpt = tmp_path / "ckpt"
    args = [*offload_args(tmp_path), "--save", str(ckpt), "--load", str(ckpt), *SAVES]
    run_pretrain(tmp_path, args, train_iters=5, loss_log=tmp_path / "first.jsonl")
    assert sorted(integrity.iteration_dirs(str(ckpt / integrity.NON_PERSISTENT_SUBDIR))) == [4]  # 2 retired by 4
    resumed = run_pretrain(tmp_path, args, train_iters=ITERS, loss_log=tmp_path / "resumed.jsonl")
    out = (tmp_path / "resumed.out").read_text()
    assert f"loaded checkpoint from {ckpt} at iteration 5" in out and "non-persistent checkpoint at" not in out
    assert [r["iteration"] for r in resumed] == [6]
