"""--save-retain-interval (2 CPU processes, offload on, tier files linked into the checkpoints): saves every 2
iterations, retaining multiples of 4. Once each checkpoint is complete the earlier ones at other iterations go,
with synchronous and with background saves; a run resumed from the newest keeps going and retires it in turn. What
stays is a checkpoint a run resumes from, and no hidden directory of a removal is left behind."""

import pytest

from launch import run_pretrain
from helpers import offload_args
from megatron.training.checkpoint import integrity

RETAIN = ["--save-interval", "2", "--save-retain-interval", "4"]


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_only_the_retained_checkpoints_and_the_newest_stay(tmp_path, mode):
    ckpt = tmp_path / "ckpt"
    args = [*offload_args(tmp_path), "--save", str(ckpt), "--load", str(ckpt), *RETAIN]
    if mode == "async":
        args.append("--async-save")
    run_pretrain(tmp_path, args, train_iters=6, loss_log=tmp_path / "run.jsonl")
    first = (tmp_path / "run.out").read_text()
    assert sorted(integrity.iteration_dirs(str(ckpt))) == [4, 6]  # 2 retired once 4 was complete
    assert "> retired the checkpoints at iterations 2 (not multiples of --save-retain-interval 4" in first
    resumed = run_pretrain(tmp_path, args, train_iters=8, loss_log=tmp_path / "run.jsonl")
    out = (tmp_path / "run.out").read_text()
    assert "loaded checkpoint from" in out and " at iteration 6" in out
    assert [r["iteration"] for r in resumed][-2:] == [7, 8]  # went on from the newest
    assert sorted(integrity.iteration_dirs(str(ckpt))) == [4, 8]  # 6, resumed from, retired by 8
    assert (ckpt / integrity.TRACKER).read_text().strip() == "8"
    assert not [p for p in ckpt.iterdir() if p.name.startswith(integrity.RETIRING)]  # the run waited for its removals
    for kept in (4, 8):
        assert integrity.status(str(integrity.checkpoint_dir(ckpt, kept))).state == "complete"
