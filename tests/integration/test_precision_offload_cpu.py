"""The precision-aware optimizer flags through the offload engine (2 CPU processes): bf16 Adam
moments in host memory and an nvme tier train with finite losses, and a run saved halfway and
resumed in new processes gives exactly the uninterrupted run's losses."""

import math

from launch import run_pretrain
from helpers import offload_args

PRECISION = ["--use-precision-aware-optimizer", "--exp-avg-dtype", "bf16", "--exp-avg-sq-dtype", "bf16"]


def test_bf16_moments_on_host_and_nvme_train_and_resume_bit_identically(tmp_path):
    def args(name):
        return [*PRECISION, *offload_args(tmp_path / name, tiers=("host", "nvme"))]

    whole = run_pretrain(tmp_path / "whole", args("whole"), train_iters=4)
    assert len(whole) == 4 and all(math.isfinite(r["loss"]) for r in whole)
    output = "".join(p.read_text() for p in (tmp_path / "whole").glob("*.out"))
    assert "state 8.0 B/param (fp32/bf16/bf16)" in output

    ckpt, log = tmp_path / "ckpt", tmp_path / "resumed.jsonl"
    first = run_pretrain(tmp_path / "a", [*args("a"), "--save", str(ckpt), "--save-interval", "2",
                                          "--exit-interval", "2"], train_iters=4, loss_log=log)
    assert len(first) == 2
    resumed = run_pretrain(tmp_path / "b", [*args("b"), "--load", str(ckpt)], train_iters=4, loss_log=log)
    assert resumed == whole
