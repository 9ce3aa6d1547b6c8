"""Make ``from launch import run_pretrain`` work however pytest is invoked."""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import pytest  # noqa: E402

BASELINE_ITERS = 3


@pytest.fixture(scope="session")
def offload_baseline(tmp_path_factory):
    """Losses of one torchrun launch of 2 ranks with the tiny model and the offload flags of
    test_offload_cpu.offload_args: what the srun and the two-node launches must reproduce."""
    from launch import losses, run_pretrain
    from test_offload_cpu import offload_args

    tmp = tmp_path_factory.mktemp("baseline")
    return losses(run_pretrain(tmp, [*offload_args(tmp), "--exit-signal-handler"], nproc=2,
                               train_iters=BASELINE_ITERS))
