"""End-to-end pretraining on CPU with 2 processes (gloo): DP=2, TP=2, PP=2.

Each layout: the run exits 0 with finite, falling losses; a run saving at iteration 5 and exiting
repeats its first 5 iterations bit for bit in new processes, and its resume in new processes to 10
equals the uninterrupted run bit for bit.
All with Megatron-LM's default dropout (0.1); DP=2 with its default --num-workers 2, whose losses
must equal those of the run that loads in the rank (--num-workers 0).
"""

import math

import pytest

from launch import LAYOUTS, losses, run_pretrain


@pytest.fixture(scope="module", params=sorted(LAYOUTS))
def layout(request, plain_runs):
    """One uninterrupted 10-iteration run per layout (conftest.plain_runs, shared with test_offload_cpu)."""
    name = request.param
    return name, LAYOUTS[name], plain_runs(name)


def test_runs_and_loss_falls(layout):
    name, _, records = layout
    assert [r["iteration"] for r in records] == list(range(1, 11)), name
    values = losses(records)
    assert all(math.isfinite(v) for v in values)
    assert all(math.isfinite(r["grad_norm"]) and r["grad_norm"] > 0 for r in records)
    assert sum(values[-3:]) / 3 < sum(values[:3]) / 3 - 0.05, values
    assert values[-1] < values[0]


def test_losses_do_not_depend_on_the_worker_count(layout, tmp_path):
    name, args, records = layout
    if "--num-workers" not in args:
        pytest.skip("the DP=2 layout covers it")
    assert run_pretrain(tmp_path, [*args, "--num-workers", "0"]) == records


def test_repeat_and_resume_from_checkpoint_are_bit_identical(layout, tmp_path):
    """The first launch repeats iterations 1-5 of the uninterrupted run (a repeat run, in new
    processes); the second resumes from its checkpoint and must give iterations 6-10."""
    name, args, records = layout
    ckpt, log = tmp_path / "ckpt", tmp_path / "resumed.jsonl"
    first = run_pretrain(tmp_path, [*args, "--save", str(ckpt), "--save-interval", "5",
                                    "--exit-interval", "5"], loss_log=log)
    assert [r["iteration"] for r in first] == [1, 2, 3, 4, 5]
    assert first == records[:5], name
    assert (ckpt / "latest_checkpointed_iteration.txt").read_text() == "5"
    resumed = run_pretrain(tmp_path, [*args, "--load", str(ckpt)], loss_log=log)
    assert resumed == records, name


def test_params_staged_in_host_memory_while_ddp_builds_give_the_same_run(tmp_path):
    """build_model's staging (forced here; on a GPU it happens where DDP's buffers would not fit beside the
    params): the params leave the device before DDP copies them into its buffer, the rest follows after."""
    baseline = run_pretrain(tmp_path / "base", [], nproc=2, train_iters=3)
    staged = run_pretrain(tmp_path / "staged", [], nproc=2, train_iters=3, env={"MLP_OFFLOAD_STAGE_PARAMS": "1"})
    assert losses(staged) == losses(baseline)
    assert "of params per rank staged in host memory while DDP builds" in (tmp_path / "staged" / "loss-0.out").read_text()
