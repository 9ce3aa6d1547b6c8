"""An NCCL failure soon after the auto gpu tier grew (offload/tier_growth.py) is said in one line naming
--offload-gpu-margin-gb and a larger value, exit status 2; any other failure, or one long after the growth,
goes on as it was raised (its traceback: a bug or another cause, not this)."""

import pytest
import torch

from megatron.training.errors import EXIT_USER_ERROR, reported_once
from megatron.training.offload import tier_growth
from megatron.training.offload.optimizer import share_device_memory

GiB = 2**30
NCCL = "NCCL error in: /pytorch/torch/csrc/distributed/c10d/NCCLUtils.cpp:93, unhandled cuda error"


@pytest.fixture(autouse=True)
def fresh():
    tier_growth.forget()
    yield
    tier_growth.forget()


def raised_in_a_run(err):
    with reported_once():
        raise err


def test_an_nccl_failure_right_after_the_tier_grew_names_the_margin(capsys):
    tier_growth.observed(16 * GiB, 35 * GiB, int(4.1 * GiB), 4 * GiB)
    with pytest.raises(SystemExit) as stop:
        raised_in_a_run(torch.distributed.DistBackendError(f"{NCCL}\nncclUnhandledCudaError: Call to CUDA function"))
    assert stop.value.code == EXIT_USER_ERROR
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: NCCL failed (NCCL error in:")
    assert "grew to 35.00 GiB, leaving 4.10 GiB" in lines[0] and "(--offload-gpu-margin-gb 4)" in lines[0]
    assert lines[0].endswith("rerun with --offload-gpu-margin-gb 8")


@pytest.mark.parametrize("steps_after", [0, 1, 2])
def test_within_two_steps_of_the_growth_it_is_named(capsys, steps_after):
    tier_growth.observed(0, GiB, GiB, 4 * GiB)
    for _ in range(steps_after):
        tier_growth.observed(GiB, GiB, GiB, 4 * GiB)  # steps that did not grow it
    with pytest.raises(SystemExit):
        raised_in_a_run(torch.distributed.DistBackendError(NCCL))
    assert f"{steps_after + 1} step(s) after" in capsys.readouterr().err


@pytest.mark.parametrize("case", ["no growth", "long after", "not NCCL", "shrank"])
def test_other_failures_keep_their_traceback(case):
    err = RuntimeError("CUDA out of memory") if case == "not NCCL" else torch.distributed.DistBackendError(NCCL)
    if case != "no growth":
        tier_growth.observed(0, GiB, GiB, 4 * GiB)
    if case == "long after":
        for _ in range(3):
            tier_growth.observed(GiB, GiB, GiB, 4 * GiB)
    if case == "shrank":
        tier_growth.forget()
        tier_growth.observed(2 * GiB, GiB, GiB, 4 * GiB)  # handed back: nothing grew
    with pytest.raises(type(err)):
        raised_in_a_run(err)


def test_the_optimizer_records_what_the_auto_tier_did(capsys):
    """share_device_memory notes each engine's growth with the room it left: peak and tier against capacity."""
    class Engine:
        class config:
            gpu_margin_bytes = 4 * GiB

        def __init__(self, grow):
            self.tier, self.grow = 10 * GiB, grow

        def state_bytes_per_tier(self):
            return {"gpu": self.tier}

        def observe_device_memory(self, peak, capacity):
            self.tier += self.grow

    assert share_device_memory([Engine(6 * GiB)], 100 * GiB, 120 * GiB)  # it grew: the caller empties the cache
    with pytest.raises(SystemExit):
        raised_in_a_run(torch.distributed.DistBackendError(NCCL))
    assert "grew to 16.00 GiB, leaving 14.00 GiB" in capsys.readouterr().err  # 120 - (100 + 6)
    tier_growth.forget()
    assert not share_device_memory([Engine(0)], 100 * GiB, 120 * GiB)
    with pytest.raises(torch.distributed.DistBackendError):
        raised_in_a_run(torch.distributed.DistBackendError(NCCL))


def test_a_growth_says_the_allocators_reserve_of_the_step_it_was_fitted_to(caplog):
    tier_growth.allocator_figures(130 * GiB, 114 * GiB)
    with caplog.at_level("INFO", logger="mlp_offload"):
        tier_growth.observed(10 * GiB, 20 * GiB, 4 * GiB, 4 * GiB)
        tier_growth.observed(20 * GiB, 20 * GiB, 4 * GiB, 4 * GiB)  # no growth: nothing said
    said = [r.getMessage() for r in caplog.records if "gpu tier grew" in r.getMessage()]
    assert said == ["gpu tier grew: in the step it was fitted to, torch's allocator reserved up to 130.00 GiB "
                    "while at most 114.00 GiB was in use"]
