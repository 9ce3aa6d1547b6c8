"""The start-up guard of host memory: a node's ranks together (engine buffers, the process, its data
workers) against the job's memory limit, else available memory; refused in one line naming
--offload-host-cache-gb, the figures and a budget that would fit. Figures injected."""

import re

import pytest
import torch
from hypothesis import given, settings, strategies as st

from megatron.training.runtime.host_memory import DATA_WORKER_BYTES, beside_engine
from megatron.training.offload.options import in_flags
from mlp_offload import GiB, HostMemoryError, OffloadedAdamW
from mlp_offload.tiers import host as host_module
from mlp_offload.tiers.host import check_host_memory
from tests.unit.helpers import fast_config

LIMIT = (128 * GiB, "this job's memory limit (cgroup)")


def _engine(cache_gib, staging_gib=0.7):
    return {"optimizer cache": int(cache_gib * GiB), "gradient staging": int(staging_gib * GiB)}


def test_the_run_that_was_killed_is_refused_in_one_line_naming_the_flag():
    # A 128 GiB node: a 74 GiB cache, 2 workers, and a 60 GiB rank process: over 134 GiB.
    with pytest.raises(HostMemoryError) as err:
        check_host_memory(_engine(74), 1, beside_engine(2, 60 * GiB), True, LIMIT)
    line = in_flags(str(err.value))
    assert "\n" not in line and "--offload-host-cache-gb" in line and "128.00 GiB of this job's memory limit" in line
    workers = 2 * DATA_WORKER_BYTES / GiB
    assert f"data workers {workers:.2f}" in line and "process 60.00" in line, line
    fits = float(re.search(r"--offload-host-cache-gb ([0-9.]+) would fit", line).group(1))
    # abs=0.11: the cache that would fit (beside 0.7 GiB of gradient staging) is cut down to a tenth of a GiB
    assert fits == pytest.approx(128 - 60 - workers - 0.7, abs=0.11)


def test_what_fits_passes():
    check_host_memory(_engine(74), 1, beside_engine(2, 6 * GiB), True, LIMIT)


@settings(max_examples=60, deadline=None, derandomize=True)
@given(ranks=st.integers(1, 8), cache=st.floats(0, 200), process=st.floats(0.2, 8), workers=st.integers(0, 8),
       limit=st.floats(16, 1024))
def test_refused_exactly_when_over_and_the_suggestion_fits(ranks, cache, process, workers, limit):
    node = (int(limit * GiB), "available memory")
    engine, beside = _engine(cache), beside_engine(workers, int(process * GiB))
    total = ranks * (sum(engine.values()) + sum(beside.values()))
    if total <= node[0]:
        check_host_memory(engine, ranks, beside, True, node)
        return
    with pytest.raises(HostMemoryError) as err:
        check_host_memory(engine, ranks, beside, True, node)
    line = in_flags(str(err.value))
    suggested = re.search(r"--offload-host-cache-gb ([0-9.]+) would fit", line)
    if suggested:  # the suggestion is accepted
        check_host_memory(_engine(float(suggested.group(1))), ranks, beside, True, node)
    else:
        assert "no --offload-host-cache-gb fits" in line


def test_without_a_file_tier_the_line_says_a_lower_budget_needs_one():
    with pytest.raises(HostMemoryError, match="needs a file tier"):
        check_host_memory(_engine(200), 1, beside_engine(2, GiB), False, LIMIT)


def test_the_engine_counts_what_the_rank_holds_beside_it_before_allocating(tmp_path, monkeypatch):
    monkeypatch.setattr(host_module, "_cgroup_limit_bytes", lambda: 64 << 20)
    allocated = []
    monkeypatch.setattr(host_module, "unforked_zeros", lambda n: allocated.append(n) or torch.zeros(n, dtype=torch.uint8))
    cfg = fast_config(tmp_path, tiers=["host"], host_bytes_beside={"data workers": GiB})
    with pytest.raises(HostMemoryError, match=r"data workers 1.00 GiB.* more than the 0.06 GiB of this job's memory"):
        OffloadedAdamW(torch.randn(10_000), cfg)
    assert not allocated


def test_host_buffers_come_zero_filled_so_the_engine_skips_zeroing_its_state():
    """The engine leaves moments (and a model-started master's remainders) as allocated: they must be zeros."""
    from mlp_offload import HostMemory

    memory = HostMemory(None, pin=False)
    assert memory.hands_out_zeros
    first = memory.allocate(3 << 20, "a")
    first.fill_(7)
    memory.release(first)
    again = memory.allocate(3 << 20, "b")  # not the released buffer's bytes
    assert not again.any()


def test_on_a_gpu_the_guard_counts_theprocess_at_its_peak_beside_the_model_in_host_memory():
    """Measured at start-up the process is smaller than in its steps (a 35.11 B run the guard admitted at a host
    tier of 52 GiB was killed for host memory in its first step): on a GPU it counts at least the model's buffers
    in host memory plus the process's measured peak beside them; a CPU run counts what it measures."""
    from types import SimpleNamespace

    import torch

    from megatron.training.offload.factory import process_at_its_peak
    from megatron.training.runtime.host_memory import PROCESS_BYTES_GPU, measured_beside_engine

    params, grads = torch.zeros(1000, dtype=torch.bfloat16), torch.zeros(1000, dtype=torch.float32)
    chunk = SimpleNamespace(buffers=[SimpleNamespace(param_data=params, grad_data=grads)], expert_parallel_buffers=[])
    assert process_at_its_peak([chunk], torch.device("cuda")) == 2000 + 4000 + PROCESS_BYTES_GPU
    assert process_at_its_peak([chunk], torch.device("cpu")) == 0
    assert process_at_its_peak([chunk], torch.device("cuda"), save_copies=700) == 2000 + 4000 + 700 + PROCESS_BYTES_GPU
    now = measured_beside_engine(0)["process"]
    assert measured_beside_engine(0, at_least=now + 10 * GiB)["process"] == now + 10 * GiB
    assert measured_beside_engine(0, at_least=1)["process"] > 10 * 2**20  # the measured figure, when larger


@pytest.mark.parametrize("fully_parallel, dp_size, dp_rank, expected", [(True, 4, 3, 500), (False, 4, 0, 2000),
                                                                        (False, 4, 1, 0), (True, 1, 0, 2000)])
def test_async_save_counts_the_params_it_copies_aside_beside_the_engine(monkeypatch, fully_parallel, dp_size, dp_rank,
                                                                        expected):
    """--async-save with the params in host memory copies what a rank writes of them aside at each save: a share
    under fully parallel saves, else all on the first data-parallel rank; nothing without --async-save."""
    from types import SimpleNamespace

    from megatron.training.offload import factory

    params = torch.zeros(1000, dtype=torch.bfloat16)
    chunk = SimpleNamespace(buffers=[SimpleNamespace(param_data=params)], expert_parallel_buffers=[],
                            compute_device=torch.device("cpu"))  # placed in host memory (host_params)
    monkeypatch.setattr(factory.parallel_state, "get_data_parallel_world_size", lambda: dp_size)
    monkeypatch.setattr(factory.parallel_state, "get_data_parallel_rank", lambda: dp_rank)
    args = SimpleNamespace(async_save=True, ckpt_fully_parallel_save=fully_parallel)
    assert factory.async_save_copy_bytes(args, [chunk]) == expected
    assert factory.async_save_copy_bytes(SimpleNamespace(async_save=False), [chunk]) == 0
