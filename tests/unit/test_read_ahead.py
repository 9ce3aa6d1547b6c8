"""Read-ahead (device_read_ahead_bytes) on the CPU twin: host-held subgroups the device updates are
copied in before their step, in series and deferred; the state stays torch.optim.AdamW's bit for bit
where the state is edited or loaded between steps (a stale copy would be used otherwise), where the
update split moves subgroups to the CPU, and the steps say how many subgroups were read ahead."""

import pytest
import torch
from hypothesis import given, settings, strategies as st

from tests.profiles import examples

from mlp_offload import ModelLink
from mlp_offload import OffloadConfig, OffloadConfigError, OffloadedAdamW
from mlp_offload.plan.placement import CPU

from .helpers import BETAS, EPS, LR, WD, engine_state

NUMEL, SUBGROUP = 12_000, 1_000  # 12 subgroups


def _engine(init, read_ahead_subgroups, deferred, gpu_subgroups=0):
    tiers = (["gpu"] if gpu_subgroups else []) + ["host"]
    cfg = OffloadConfig(tiers=tiers, subgroup_size=SUBGROUP, update_on="device", defer_device_wait=deferred,
                        gpu_budget_bytes=gpu_subgroups * SUBGROUP * 12 if gpu_subgroups else None,
                        device_read_ahead_bytes=read_ahead_subgroups * SUBGROUP * 12, adam_kernel="single",
                        adam_elems_per_s=1e9, device_adam_elems_per_s=4e9, device_streamed_elems_per_s=2e9)
    return OffloadedAdamW(init.clone(), cfg, lr=LR, betas=BETAS, eps=EPS, weight_decay=WD,
                          model=ModelLink(grad_dtype=torch.bfloat16))


@settings(max_examples=examples(25), deadline=None, derandomize=True)
@given(slots=st.integers(1, 14), deferred=st.booleans(), gpu=st.integers(0, 4),
       between=st.lists(st.sampled_from(["none", "edit", "load", "to_cpu", "forward_half"]), min_size=4, max_size=4))
def test_read_ahead_steps_equal_adamw_with_edits_loads_and_split_changes(slots, deferred, gpu, between):
    gen = torch.Generator().manual_seed(slots * 7 + gpu)
    init = torch.randn(NUMEL, generator=gen)
    ref = torch.nn.Parameter(init.clone())
    opt = torch.optim.AdamW([ref], lr=LR, betas=BETAS, eps=EPS, weight_decay=WD)
    eng = _engine(init, slots, deferred, gpu)
    try:
        n = len(eng.subgroups)
        on_device = eng.placement.tier_of.count("host")  # host-held subgroups (the device updates them all)
        held = 0  # copies read ahead of the next step, as the events below leave them
        for step, event in enumerate(between):
            grad = (torch.randn(NUMEL, generator=gen) * 10).to(torch.bfloat16)
            eng.settle()
            eng.grad_buffer.copy_(grad)
            rec = eng.step()
            ref.grad = grad.float()
            opt.step()
            eng.settle()  # the deferred work queued (its read-ahead for the next step issued with the last)
            assert rec.read_ahead == held  # the step took every copy still held, and only those
            held = min(slots, on_device)  # read ahead of the next step: its first host-held device subgroups
            if event == "edit":  # the host state changes under the copies read ahead: they must go
                eng.modify_state(lambda sg, p, m, v: m.mul_(0.5))
                opt.state[ref]["exp_avg"].mul_(0.5)
                held = 0
            elif event == "load":
                params, exp_avg, exp_avg_sq = (t + 0.25 for t in engine_state(eng))
                eng.load_state(lambda sg, p, m, v: (p.copy_(params[sg.start:sg.end]), m.copy_(exp_avg[sg.start:sg.end]),
                                                   v.copy_(exp_avg_sq[sg.start:sg.end])), eng.steps_done)
                with torch.no_grad():
                    ref.add_(0.25)
                    opt.state[ref]["exp_avg"].add_(0.25)
                    opt.state[ref]["exp_avg_sq"].add_(0.25)
                held = 0
            elif event == "to_cpu" and on_device:  # the split gives the CPU the subgroup read ahead first
                order = eng.update_order()
                first = next(i for i in order if eng.placement.tier_of[i] != "gpu")
                eng.placement.update_on[first] = CPU
                on_device, held = on_device - 1, held - 1
            elif event == "forward_half" and deferred:
                for i in range(n - 1, n // 2, -1):
                    eng.params_ready(i)
        params, exp_avg, exp_avg_sq = engine_state(eng)
    finally:
        eng.close()
    assert torch.equal(params, ref.detach())
    assert torch.equal(exp_avg, opt.state[ref]["exp_avg"])
    assert torch.equal(exp_avg_sq, opt.state[ref]["exp_avg_sq"])


@pytest.mark.parametrize("deferred", [False, True])
def test_read_ahead_covers_the_first_subgroups_of_the_next_steps_order(deferred):
    init = torch.randn(NUMEL)
    eng = _engine(init, 3, deferred)
    try:
        eng.grad_buffer.copy_(torch.ones(NUMEL, dtype=torch.bfloat16))
        eng.step()
        eng.settle()
        order = eng.update_order()
        assert sorted(eng.read_ahead.held) == sorted(order[:3])
        eng.grad_buffer.copy_(torch.ones(NUMEL, dtype=torch.bfloat16))
        assert eng.step().read_ahead == 3
    finally:
        eng.close()


def test_a_read_ahead_below_one_subgroup_names_the_field_and_the_size():
    with pytest.raises(OffloadConfigError, match=r"device_read_ahead_bytes=1000 holds no subgroup.*1000 elements"):
        OffloadedAdamW(torch.zeros(NUMEL), OffloadConfig(tiers=["host"], subgroup_size=SUBGROUP, update_on="device",
                                                         device_read_ahead_bytes=1000, adam_elems_per_s=1e9))
