"""The gpu tier and the device update (CPU twin: the device is the CPU here): over tier mixes,
budgets, update sides, chunk sizes and auto relocations mid-run, the engine must equal
torch.optim.AdamW bit for bit; checkpoints cross between tier mixes; the auto mode's policy."""

import tempfile

import pytest
import torch
from hypothesis import given, settings, strategies as st

from mlp_offload import ModelLink
from mlp_offload import OffloadConfig, OffloadConfigError, OffloadedAdamW, PlacementError
from mlp_offload.checkpoint import load_engine_state
from mlp_offload.checkpoint.write import save_engine_state
from mlp_offload.plan.placement import CPU, DEVICE, UpdateRates, split_updates
from mlp_offload.relocation import device_change
from mlp_offload.subgroups.partition import partition

from .helpers import BETAS, EPS, LR, WD, adamw_reference, assert_state_equals_reference, device_config, engine_state
from .strategies import DEVICE_RATES as RATES, device_setups

def _ref_step(pieces, opt, grad):
    for (a, b), p in pieces:
        p.grad = grad.float()[a:b].clone()
    opt.step()


@settings(max_examples=60, deadline=None, derandomize=True, print_blob=True)
@given(case=device_setups(), seed=st.integers(0, 3))
def test_tier_mixes_and_update_sides_match_torch_adamw(case, seed):
    setup, extra, relocate = case
    gen = torch.Generator().manual_seed(seed)
    init = torch.randn(setup.numel, generator=gen)
    pieces, opt = adamw_reference(setup, init, setup.options["adam_kernel"])
    seen = []
    with tempfile.TemporaryDirectory() as root:
        cfg = device_config(setup, extra, root)
        with OffloadedAdamW(init.clone(), cfg, lr=LR, betas=BETAS, eps=EPS, weight_decay=WD, groups=setup.groups,
                            model=ModelLink(on_params_updated=lambda a, b, p: seen.append((a, b, p.clone())))) as eng:
            for step in range(3):
                grad = (torch.randn(setup.numel, generator=gen) * 10).to(torch.bfloat16)
                eng.grad_buffer.copy_(grad)
                seen.clear()
                rec = eng.step()
                _ref_step(pieces, opt, grad)
                assert rec.cpu_updated + rec.device_updated == len(eng.subgroups)
                # every element's updated master param handed over once, equal to torch's
                handed = torch.full((setup.numel,), float("nan"))
                for a, b, p in seen:
                    assert handed[a:b].isnan().all()
                    handed[a:b] = p
                whole = torch.cat([p.detach() for _, p in sorted(pieces, key=lambda x: x[0])]) \
                    if setup.groups is None else None
                if whole is not None:
                    assert torch.equal(handed, whole)
                if relocate and step < 2:
                    eng.observe_device_memory(*relocate[step])
            assert_state_equals_reference(eng, pieces, opt)
            held = eng.state_bytes_per_tier()
            if "gpu" in cfg.tiers:
                assert held["gpu"] == sum(eng.subgroups[i].state_bytes for i in eng.placement.subgroups_on("gpu"))
                assert eng.memory["gpu"].used_bytes == held["gpu"]


@pytest.mark.parametrize("save_tiers,load_tiers", [
    (["gpu", "host"], ["host"]), (["host"], ["gpu", "host"]), (["gpu", "nvme"], ["gpu", "host", "nvme"]),
    (["gpu", "host", "nvme"], ["nvme"])])
def test_checkpoints_cross_tier_mixes_and_continue_bit_identically(tmp_path, save_tiers, load_tiers):
    numel, sub = 50_001, 7_000
    gen = torch.Generator().manual_seed(1)
    init = torch.randn(numel, generator=gen)
    grads = [(torch.randn(numel, generator=gen) * 10).to(torch.bfloat16) for _ in range(5)]
    slot = partition(numel, sub)[0].state_bytes

    def config(tiers, d):
        paths = {"nvme": str(tmp_path / d)} if "nvme" in tiers else {}
        (tmp_path / d).mkdir(exist_ok=True)
        return OffloadConfig(tiers=tiers, paths=paths, subgroup_size=sub, run_id=d, pin_memory=False,
                             gpu_budget_bytes=3 * slot if "gpu" in tiers else None,
                             host_budget_bytes=4 * slot if "host" in tiers and paths else None,
                             bandwidths={t: (2e9, 1e9) for t in paths}, adam_kernel="single",
                             update_on="auto", device_chunk_elems=3_000, **RATES)

    def engine(tiers, d):
        return OffloadedAdamW(init.clone(), config(tiers, d), lr=LR, betas=BETAS, eps=EPS, weight_decay=WD)

    def run(eng, gs):
        for g in gs:
            eng.grad_buffer.copy_(g)
            eng.step()

    with engine(["host"], "ref") as ref:
        run(ref, grads)
        want = engine_state(ref)
    with engine(save_tiers, "a") as a:
        run(a, grads[:3])
        save_engine_state(a, str(tmp_path / "state.offload"))
    with engine(load_tiers, "b") as b:
        load_engine_state(b, str(tmp_path / "state.offload"))
        assert b.steps_done == 3
        run(b, grads[3:])
        got = engine_state(b)
    for w, g in zip(want, got):
        assert torch.equal(w, g)


def test_auto_promotes_into_spare_memory_and_hands_back_under_pressure(tmp_path):
    numel, sub = 60_000, 10_000
    slot = partition(numel, sub)[0].state_bytes
    cfg = OffloadConfig(tiers=["gpu", "host", "nvme"], paths={"nvme": str(tmp_path)}, subgroup_size=sub,
                        host_budget_bytes=3 * slot, gpu_budget_auto=True, gpu_margin_bytes=slot // 2,
                        bandwidths={"nvme": (2e9, 1e9)}, run_id="auto", pin_memory=False, adam_kernel="single",
                        update_on="cpu", **RATES)
    gen = torch.Generator().manual_seed(2)
    init = torch.randn(numel, generator=gen)
    ref = torch.nn.Parameter(init.clone())
    opt = torch.optim.AdamW([ref], lr=LR, betas=BETAS, eps=EPS, weight_decay=WD, foreach=False)
    with OffloadedAdamW(init.clone(), cfg, lr=LR, betas=BETAS, eps=EPS, weight_decay=WD) as eng:
        assert eng.placement.subgroups_on("gpu") == []  # auto starts empty: nothing is known yet
        allocate, buffers = eng.host.allocate, []
        eng.host.allocate = lambda n, what, **kw: buffers.append(what) or allocate(n, what, **kw)
        figures = [(slot, 5 * slot), (0, 1 * slot), (0, 0), (2 * slot, slot)]
        on_gpu = []
        for peak, capacity in figures:
            grad = (torch.randn(numel, generator=gen) * 10).to(torch.bfloat16)
            eng.grad_buffer.copy_(grad)
            eng.step()
            ref.grad = grad.float()
            opt.step()
            said = eng.observe_device_memory(peak, capacity)
            on_gpu.append(len(eng.placement.subgroups_on("gpu")))
            assert said is None or "gpu tier auto" in said
        # 5 - 1 - 0.5 = 3.5 spare -> 3 promoted (file-streamed ones first); then 1 - 0 - 0.5 = 0.5:
        # nothing; then short by 0.5 -> one handed back; then short by 1.5 -> the other two handed back
        assert on_gpu == [3, 3, 2, 0]
        assert eng.memory["gpu"].used_bytes == 0
        # the streamed subgroups moved pass through one scratch buffer, not one new buffer each
        assert buffers.count("checkpoint buffer") == 1, buffers
        # device-resident subgroups were updated on the device side, all others by the CPU
        params, exp_avg, exp_avg_sq = engine_state(eng)
    assert torch.equal(params, ref.detach())
    assert torch.equal(exp_avg, opt.state[ref]["exp_avg"])
    assert torch.equal(exp_avg_sq, opt.state[ref]["exp_avg_sq"])


def test_device_change_policy():
    assert device_change(peak_bytes=10, capacity_bytes=100, margin_bytes=20, subgroup_bytes=30) == 2
    assert device_change(peak_bytes=80, capacity_bytes=100, margin_bytes=20, subgroup_bytes=30) == 0
    assert device_change(peak_bytes=81, capacity_bytes=100, margin_bytes=20, subgroup_bytes=30) == -1
    assert device_change(peak_bytes=150, capacity_bytes=100, margin_bytes=20, subgroup_bytes=30) == -3


@settings(max_examples=50, deadline=None, derandomize=True)
@given(n=st.integers(1, 40), cpu=st.floats(0.1, 10), dev=st.floats(0.1, 10), gpu=st.integers(0, 5))
def test_auto_split_balances_the_two_sides(n, cpu, dev, gpu):
    subgroups = partition(n * 1000, 1000)
    tier_of = ["gpu" if i < gpu else "host" for i in range(n)]
    rates = UpdateRates(cpu=cpu, device_resident=2 * dev, device_streamed=dev)
    sides = split_updates(subgroups, tier_of, "auto", rates)
    assert all(sides[i] == DEVICE for i in range(min(gpu, n)))
    t_cpu = sides.count(CPU) * 1000 / cpu
    t_dev = sum(1000 / (2 * dev if i < gpu else dev) for i in range(n) if sides[i] == DEVICE)
    # list scheduling: the later side finishes no more than one subgroup's time after the earlier,
    # unless the device's resident share alone is the longer one (then every other went to the CPU)
    t_fixed = min(gpu, n) * 1000 / (2 * dev)
    if not (t_dev == t_fixed and t_cpu <= t_dev):
        assert max(t_cpu, t_dev) - min(t_cpu, t_dev) <= 1000 / min(cpu, dev) + 1e-9
    assert split_updates(subgroups, tier_of, "cpu", rates).count(DEVICE) == min(gpu, n)
    assert split_updates(subgroups, tier_of, "device", rates) == [DEVICE] * n


@settings(max_examples=40, deadline=None, derandomize=True)
@given(n=st.integers(2, 30), cpu=st.floats(0.5, 10), dev=st.floats(0.5, 10), slow=st.floats(0.2, 1.0),
       gpu=st.integers(0, 4))
def test_split_and_prediction_use_the_rates_measured_side_by_side(n, cpu, dev, slow, gpu):
    """Where both sides work, each is priced at the rate measured beside the other (a reference
    computed here from the sides the split chose); a side alone keeps its solo rate."""
    from mlp_offload.plan.placement import Placement
    from mlp_offload.plan.prediction import MeasuredRates, predict_update

    subgroups = partition(n * 1000, 1000)
    tier_of = ["gpu" if i < gpu else "host" for i in range(n)]
    rates = UpdateRates(cpu=cpu, device_resident=20 * dev, device_streamed=dev,
                        cpu_shared=cpu * slow, streamed_shared=dev * slow)
    sides = split_updates(subgroups, tier_of, "auto", rates)
    # the split balances at the shared rates: what list scheduling at those rates gives
    assert sides == split_updates(subgroups, tier_of, "auto", UpdateRates(
        cpu=cpu * slow, device_resident=20 * dev, device_streamed=dev * slow))
    placement = Placement(tier_of=tier_of, slots=0, cache_slots=0, resident_bytes={}, update_on=sides)
    pred = predict_update(subgroups, placement, MeasuredRates({}, cpu, 1e30, rates))
    streams = any(s == DEVICE and t == "host" for s, t in zip(sides, tier_of))
    cpu_rate = cpu * slow if streams else cpu
    stream_rate = dev * slow if CPU in sides else dev
    t_cpu = sides.count(CPU) * 1000 / cpu_rate
    # the device's in-HBM updates and its streamed ones' interleaved (the step loop's order on a GPU): the
    # compute stream updates both at the resident rate while the link streams, the longer wins
    hbm = sum(1000 / (20 * dev) for s, t in zip(sides, tier_of) if s == DEVICE and t == "gpu")
    streamed = sum(1000 for s, t in zip(sides, tier_of) if s == DEVICE and t == "host")
    link = streamed / stream_rate
    t_dev = max(link, hbm + streamed / (20 * dev)) if hbm and streamed else hbm + link
    # rel=1e-9: the prediction adds per-subgroup float seconds in the schedule's order, this in the list's
    assert pred.adam_s == pytest.approx(t_cpu, rel=1e-9, abs=1e-12)
    assert pred.device_s == pytest.approx(t_dev, rel=1e-9, abs=1e-12)
    assert pred.update_s == pytest.approx(max(t_cpu, t_dev), rel=1e-9)


@pytest.mark.parametrize("options,says", [
    (dict(tiers=["gpu", "host"]), "gpu_budget_bytes or gpu_budget_auto"),
    (dict(tiers=["host"], gpu_budget_bytes=1 << 20), "'gpu' is not one of the offload tiers"),
    (dict(tiers=["gpu"], gpu_budget_auto=True), "nowhere to keep"),
    (dict(tiers=["host"], update_on="gpu"), "update_on"),
    (dict(tiers=["gpu", "host"], gpu_budget_bytes=-1), "gpu_budget_bytes"),
])
def test_bad_device_settings_name_the_field(options, says):
    with pytest.raises(OffloadConfigError, match=says):
        OffloadConfig(**options)


def test_gpu_only_budget_below_the_state_names_the_budget():
    with pytest.raises(PlacementError, match="gpu_budget_bytes"):
        OffloadedAdamW(torch.zeros(50_000), OffloadConfig(tiers=["gpu"], gpu_budget_bytes=1 << 16,
                                                          subgroup_size=10_000, **RATES)).close()


def test_two_engines_on_one_device_share_its_spare_memory():
    """An MoE model's dense and expert engines learn one device's gpu tier together: memory one of
    them takes (or hands back) counts in the peak the other sees, never taken twice."""
    from megatron.training.offload.optimizer import share_device_memory

    sub = 10_000
    slot = partition(4 * sub, sub)[0].state_bytes
    engines = []
    for name, numel in (("dense", 4 * sub), ("experts", 3 * sub)):
        cfg = OffloadConfig(tiers=["gpu", "host"], subgroup_size=sub, gpu_budget_auto=True, gpu_margin_bytes=0,
                            run_id=f"share-{name}", pin_memory=False, adam_kernel="single", update_on="cpu",
                            **RATES)
        engines.append(OffloadedAdamW(torch.zeros(numel), cfg, lr=LR, betas=BETAS, eps=EPS, weight_decay=WD))
    try:
        held = []
        # 5 subgroups of room: the dense engine takes its 4, the experts' the 1 left; then the peak with
        # both tiers in it leaves none; then a peak 2 over: the dense engine hands back 2, enough for both
        for peak, capacity in ((slot, 6 * slot), (6 * slot, 6 * slot), (8 * slot, 6 * slot)):
            for eng in engines:
                eng.step()
            share_device_memory(engines, peak, capacity)
            held.append([len(eng.placement.subgroups_on("gpu")) for eng in engines])
        assert held == [[4, 1], [4, 1], [2, 1]]
        assert [eng.memory["gpu"].used_bytes for eng in engines] == [2 * slot, slot]
    finally:
        for eng in engines:
            eng.close()
