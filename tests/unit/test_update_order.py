"""The device's order of the subgroups held in memory (``step.loop.interleaved``): the in-HBM ones spread
evenly between the streamed ones, a streamed one first, each kind in its own order; and an engine's
order (the CPU twin runs the GPU's order) with the option on and off."""

import pytest
import torch
from hypothesis import given, settings, strategies as st

from mlp_offload import OffloadConfig, OffloadedAdamW
from mlp_offload.step.loop import interleaved
from tests.profiles import examples

from .helpers import engine_state


@settings(max_examples=examples(300), deadline=None)
@given(flags=st.lists(st.booleans(), max_size=40), seed=st.randoms(use_true_random=False))
def test_in_hbm_subgroups_are_spread_between_the_streamed_ones(flags, seed):
    order = list(range(len(flags)))
    seed.shuffle(order)
    in_hbm = dict(zip(order, flags))
    got = interleaved(order, in_hbm.__getitem__)
    assert sorted(got) == sorted(order)
    streamed = [i for i in order if not in_hbm[i]]
    resident = [i for i in order if in_hbm[i]]
    assert [i for i in got if not in_hbm[i]] == streamed  # each kind keeps its order
    assert [i for i in got if in_hbm[i]] == resident
    if not streamed or not resident:
        assert got == order
        return
    assert not in_hbm[got[0]]  # the link starts at once
    runs, run = [], 0  # in-HBM subgroups after each streamed one
    for i in got[1:]:
        if in_hbm[i]:
            run += 1
        else:
            runs.append(run)
            run = 0
    runs.append(run)
    assert len(runs) == len(streamed) and sum(runs) == len(resident)
    assert max(runs) - min(runs) <= 1  # evenly


@pytest.mark.parametrize("interleave", [True, False])
def test_the_engine_queues_its_held_subgroups_interleaved_unless_told_not_to(tmp_path, interleave):
    numel, sub = 80_000, 10_000  # 8 subgroups: 2 or 3 in the gpu tier, the rest in host memory
    cfg = OffloadConfig(tiers=["gpu", "host"], subgroup_size=sub, update_on="device", run_id="order",
                        gpu_budget_bytes=3 * sub * 12, host_budget_bytes=8 * sub * 12, adam_elems_per_s=1e9,
                        interleave_device_updates=interleave)
    with OffloadedAdamW(torch.randn(numel), cfg) as eng:
        tiers = eng.placement.tier_of
        assert 2 <= tiers.count("gpu") <= tiers.count("host"), tiers
        order = eng.update_order()
        kinds = ["gpu" if tiers[i] == "gpu" else "host" for i in order]
        assert sorted(order) == list(range(8))
        runs_of_gpu = "".join("g" if k == "gpu" else "h" for k in kinds)
        if interleave:
            assert runs_of_gpu[0] == "h" and "gg" not in runs_of_gpu, runs_of_gpu
        else:
            assert order == list(eng.schedule.order), (order, eng.schedule.order)
        if interleave:
            assert order != list(eng.schedule.order)  # (the schedule starts with an in-HBM subgroup here)


def test_a_deferred_step_runs_the_next_forwards_order_unless_the_caller_waits_for_it():
    """defer_device_wait: the held subgroups in the next forward's order (descending); a step its caller waits for
    (the overlap's settled steps, ``in_series``) in a step in series' order, the in-HBM ones interleaved; both
    leave the bits an engine in series leaves."""
    numel, sub = 80_000, 10_000
    gen = torch.Generator().manual_seed(4)
    init = torch.randn(numel, generator=gen)
    options = dict(tiers=["gpu", "host"], subgroup_size=sub, update_on="device", run_id="order2",
                   gpu_budget_bytes=3 * sub * 12, host_budget_bytes=8 * sub * 12, adam_elems_per_s=1e9)
    engines = [OffloadedAdamW(init.clone(), OffloadConfig(**options, defer_device_wait=deferred), lr=1e-3)
               for deferred in (True, False)]
    try:
        deferred = engines[0]
        tiers = deferred.placement.tier_of
        assert deferred.update_order() == sorted(deferred.update_order(), reverse=True)
        kinds = "".join("g" if tiers[i] == "gpu" else "h" for i in deferred.update_order(in_series=True))
        assert kinds[0] == "h" and "gg" not in kinds, kinds
        for step in range(4):
            grad = (torch.randn(numel, generator=gen) * 10).to(torch.bfloat16)
            for eng in engines:
                eng.settle()
                eng.grad_buffer.copy_(grad)
                eng.step(in_series=step % 2 == 0)
        got, want = (engine_state(eng) for eng in engines)
    finally:
        for eng in engines:
            eng.close()
    assert all(torch.equal(a, b) for a, b in zip(got, want))
