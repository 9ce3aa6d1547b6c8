"""--calculate-per-token-loss (Megatron-LM's Llama-3 example uses it): gradients averaged over the
step's tokens instead of per micro-batch, through megatron-core's schedule and finalize_model_grads.

When every token counts (mock data), both averages are the same number, so the curves agree to
rounding; with --eod-mask-loss on real data the micro-batches hold different token counts and the
offloaded optimizer must still equal megatron-core's bit for bit.
"""

import math

import pytest

from conftest import REAL_DATA_ITERS as ITERS
from tests.integration.launch import run_pretrain


def losses(records):
    assert [r["iteration"] for r in records] == list(range(1, ITERS + 1))
    return [r["loss"] for r in records]


@pytest.fixture(scope="module")
def mock_runs(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("per_token_mock")
    return (run_pretrain(tmp / "default", [], train_iters=ITERS),
            run_pretrain(tmp / "per_token", ["--calculate-per-token-loss"], train_iters=ITERS))


def test_equals_the_micro_batch_average_when_every_token_counts(mock_runs):
    default, per_token = mock_runs
    # Not ==: per-token loss sums loss x mask over the micro-batches and divides once at the end, the
    # default averages each micro-batch first; the same value up to float rounding of the two orders.
    for a, b in zip(losses(default), losses(per_token)):
        assert math.isclose(a, b, rel_tol=1e-5), (losses(default), losses(per_token))


def test_masked_tokens_offload_equals_megatron_core(real_data_runs):
    """Real data with --eod-mask-loss (conftest.real_data_runs)."""
    plain, offloaded = real_data_runs(True, False), real_data_runs(True, True)
    assert losses(offloaded) == losses(plain)
    assert [r["grad_norm"] for r in offloaded] == [r["grad_norm"] for r in plain]
    # The flag changes the update once token counts differ: the micro-batch average gives another curve.
    averaged = real_data_runs(False, False)
    assert losses(averaged)[0] == losses(plain)[0] and losses(averaged)[1:] != losses(plain)[1:]
