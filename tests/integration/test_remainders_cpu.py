"""Lossless 16-bit master remainders, on by default with --bf16 (2 CPU processes, DP=2, 4 iterations,
saves at 2). The reference is megatron-core's own distributed optimizer with one change, made in the
test (half_away_megatron.py): its fp32 master goes to the bf16 model params rounded half away from zero
instead of to nearest even, which is what the engine's remainders give the model while keeping the
same fp32 master. Losses, grad norms and learning rates must be bit-identical to it, from the start
and after every resume: same form on other tiers, and across forms in both directions (7 launches)."""

import pytest

from helpers import copy_checkpoint, half_away_megatron, offload_args
from launch import run_pretrain

ITERS, SAVED_AT = 4, 2


def saving(ckpt):
    return ["--save", str(ckpt), "--save-interval", str(SAVED_AT)]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """The reference and the offloaded run with the default flags on host+nvme, both uninterrupted;
    their checkpoints of iteration 2 alone in ``ref-ckpt`` and ``rem-ckpt``."""
    tmp = tmp_path_factory.mktemp("remainders")
    reference = half_away_megatron(tmp / "ref", saving(tmp / "ref-saves"), ITERS)
    offloaded = run_pretrain(tmp / "rem", [*offload_args(tmp / "rem", tiers=("host", "nvme"), remainders=True),
                                           *saving(tmp / "rem-saves")], train_iters=ITERS)
    copy_checkpoint(tmp / "ref-saves", [SAVED_AT], tmp / "ref-ckpt")
    copy_checkpoint(tmp / "rem-saves", [SAVED_AT], tmp / "rem-ckpt")
    return tmp, reference, offloaded


def test_default_stores_remainders_and_matches_half_away_megatron_core(runs):
    tmp, reference, offloaded = runs
    assert [r["iteration"] for r in reference] == list(range(1, ITERS + 1))
    assert offloaded == reference
    output = (tmp / "rem" / "loss-0.out").read_text()
    assert "state 10.0 B/param (rem16/fp32/fp32)" in output, output[-3000:]


def test_resume_on_other_tiers_is_bit_identical(runs):
    tmp, reference, _ = runs
    resumed = run_pretrain(tmp / "same", [*offload_args(tmp / "same", tiers=("nvme",), subgroup="2500",
                                                        remainders=True), "--load", str(tmp / "rem-ckpt")],
                           train_iters=ITERS)
    assert resumed == reference[SAVED_AT:]


def test_remainders_checkpoint_resumes_in_megatron_core(runs):
    """Offload form with remainders -> megatron-core's optimizer: the master merged with the model's
    loaded params, exactly the reference's."""
    tmp, reference, _ = runs
    assert half_away_megatron(tmp / "to-plain", ["--load", str(tmp / "rem-ckpt")], ITERS) == reference[SAVED_AT:]


def test_megatron_core_checkpoint_resumes_with_remainders(runs):
    """megatron-core's form (fp32 master) -> the offload engine with remainders: split as it loads."""
    tmp, reference, _ = runs
    resumed = run_pretrain(tmp / "from-plain", [*offload_args(tmp / "from-plain", remainders=True),
                                                "--load", str(tmp / "ref-ckpt")], train_iters=ITERS)
    assert resumed == reference[SAVED_AT:]


def test_remainders_checkpoint_resumes_without_remainders(runs):
    """Offload form with remainders -> the engine keeping the whole fp32 master (merged with the
    model's loaded params as it loads): it goes on as megatron-core's own optimizer resumed from the
    reference's checkpoint (the same master and model params), rounding to nearest even from then on."""
    tmp, _, _ = runs
    plain = run_pretrain(tmp / "plain-on", ["--load", str(tmp / "ref-ckpt")], train_iters=ITERS)
    resumed = run_pretrain(tmp / "off", [*offload_args(tmp / "off", tiers=("nvme",)), "--load", str(tmp / "rem-ckpt")],
                           train_iters=ITERS)
    assert [r["iteration"] for r in plain] == [3, 4]
    assert resumed == plain
