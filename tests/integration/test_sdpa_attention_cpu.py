"""torch's scaled_dot_product_attention (--attention-backend flash) against megatron-core's unfused
attention (--attention-backend local) in a tiny GPT with GQA on 2 CPU processes (DP=2, bf16): the
losses of 4 iterations agree within bf16 rounding, and a checkpoint saved with either attention
resumes with the other, its next losses within the same rounding of the saving run's own."""

import pytest

from conftest import copy_checkpoint
from launch import losses, run_pretrain

ITERS, SAVED_AT = 4, 2
# GQA (4 heads over 2 groups). No attention dropout: the two kernels draw their masks their own way
# (on CUDA SDPA's kernels draw in-kernel), and that is not rounding.
FLAGS = ["--group-query-attention", "--num-query-groups", "2", "--attention-dropout", "0"]
KERNELS = {"sdpa": ["--attention-backend", "flash"], "unfused": ["--attention-backend", "local"]}
# bf16 keeps 8 bits (2^-8 = 3.9e-3 relative); the two kernels round scores, probabilities and sums
# at different points, and the loss averages those differences over a step's 256 tokens. Seen: at
# most 1.1e-5 relative over 4 iterations. A run resuming from a wrong or unloaded checkpoint is off
# by the 2-iteration change of the loss (6e-3 to 9e-3 relative).
REL = 4e-4


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Each kernel's 4-iteration run, saving at iteration 2."""
    tmp = tmp_path_factory.mktemp("sdpa")
    return tmp, {name: run_pretrain(tmp / name, [*FLAGS, *flags, "--save", str(tmp / f"{name}-ckpt"),
                                                 "--save-interval", str(SAVED_AT)], train_iters=ITERS)
                 for name, flags in KERNELS.items()}


def _close(got, want):
    return all(abs(g - w) <= REL * abs(w) for g, w in zip(got, want)) and len(got) == len(want)


def test_losses_within_bf16_rounding_of_the_unfused_attention(runs):
    _, records = runs
    sdpa, unfused = losses(records["sdpa"]), losses(records["unfused"])
    assert len(sdpa) == ITERS and _close(sdpa, unfused), (sdpa, unfused)
    assert sdpa != unfused  # two kernels really ran (bf16 rounds them apart)


@pytest.mark.parametrize("saved_by, resumed_with", [("unfused", "sdpa"), ("sdpa", "unfused")])
def test_checkpoint_resumes_with_the_other_attention(runs, saved_by, resumed_with):
    tmp, records = runs
    saved = copy_checkpoint(tmp / f"{saved_by}-ckpt", [SAVED_AT], tmp / f"{saved_by}-ckpt-{SAVED_AT}")
    resumed = run_pretrain(tmp / f"{saved_by}-to-{resumed_with}",
                           [*FLAGS, *KERNELS[resumed_with], "--load", str(saved)], train_iters=ITERS)
    assert [r["iteration"] for r in resumed] == list(range(SAVED_AT + 1, ITERS + 1))
    want = losses(records[saved_by])[SAVED_AT:]
    assert _close(losses(resumed), want), (losses(resumed), want)
