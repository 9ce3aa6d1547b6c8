"""The CPU's share under defer_device_wait (plan/overlap_split.py): its time model against a
step-by-step simulation written here and against the iteration model it extends
(``predict_iteration``), its choice against every count, and engines on the CPU twin that update
the CPU's share in the step and still equal an all-CPU engine bit for bit."""

import dataclasses
import logging

import pytest
import torch
from hypothesis import given, settings, strategies as st

from mlp_offload import OffloadConfig, OffloadConfigError, OffloadedAdamW, predict_iteration
from mlp_offload.plan.overlap_split import SideWork, choose_overlapped_count, overlapped_sides, overlapped_times
from mlp_offload.plan.placement import CPU, DEVICE, Placement, UpdateRates, spread
from mlp_offload.plan.split import SideRates
from mlp_offload.relocation import Relocation
from mlp_offload.subgroups.partition import partition
from mlp_offload.telemetry.traffic import StepRecord
from tests.profiles import examples

from .helpers import bf16_grads, engine_state

rate = st.floats(1e8, 1e10)


def simulated_times(work: SideWork, r: SideRates, hidden_s: float, steps: int = 20_000):
    """(CPU end, device end, visible) by stepping time: each side's elements left shrink at its rate
    beside the other while both have work, alone after; the device takes its device-memory share
    (at the resident rate, unslowed) before its streamed one. Visible as the module docstring says."""
    hbm_s = work.in_device_memory / r.resident if work.in_device_memory else 0.0
    cpu_alone = work.cpu / r.cpu_alone
    device_alone = hbm_s + work.streamed / r.streamed_alone
    dt = max(cpu_alone, device_alone, 1e-12) * 2 / steps
    cpu_left, hbm_left, streamed_left = float(work.cpu), float(work.in_device_memory), float(work.streamed)
    t, cpu_end, device_end = 0.0, 0.0 if not work.cpu else None, 0.0 if not (hbm_left or streamed_left) else None
    both = work.cpu and work.streamed  # the sides share the host only where both touch host state
    while cpu_end is None or device_end is None:
        beside = both and cpu_end is None and device_end is None
        if cpu_end is None:
            cpu_left -= dt * (r.cpu_beside if beside else r.cpu_alone)
            if cpu_left <= 0:
                cpu_end = t + dt
        if device_end is None:
            if hbm_left > 0:
                hbm_left -= dt * r.resident
            else:
                streamed_left -= dt * (r.streamed_beside if beside else r.streamed_alone)
            if hbm_left <= 0 and streamed_left <= 0:
                device_end = t + dt
        t += dt
    return cpu_end, device_end, max(cpu_end, hbm_s, device_end - hidden_s), dt


@st.composite
def works(draw):
    rates = SideRates(draw(rate), draw(rate), draw(rate), draw(rate), draw(rate))
    # the beside rates never above the rates alone (they share the host)
    rates.cpu_beside = min(rates.cpu_beside, rates.cpu_alone)
    rates.streamed_beside = min(rates.streamed_beside, rates.streamed_alone)
    size = st.sampled_from([0, 10**7, 10**8, 3 * 10**8])
    return SideWork(draw(size), draw(size), draw(size)), rates, draw(st.floats(0.0, 0.5))


@settings(max_examples=examples(200))
@given(case=works())
def test_times_match_a_step_by_step_simulation(case):
    """Where the device's share in device memory comes first (an order the simulation picks; the
    model averages over orders), the closed form and the simulation agree within a few steps."""
    work, rates, hidden_s = case
    got = overlapped_times(work, rates, hidden_s)
    cpu_end, device_end, visible, dt = simulated_times(work, rates, hidden_s)
    if work.in_device_memory and work.cpu and work.streamed:
        # the model mixes the device's parts over its time; the simulation runs them in a row: the
        # device ends no earlier in the model than in the simulation's worst order, and no later
        # than where the CPU were beside all of the device's work
        assert got.device_s <= work.in_device_memory / rates.resident + work.streamed / rates.streamed_beside + dt
        return
    tolerance = 3 * dt
    assert got.cpu_s == pytest.approx(cpu_end, abs=tolerance)
    assert got.device_s == pytest.approx(device_end, abs=tolerance)
    assert got.visible_s == pytest.approx(visible, abs=tolerance)


@settings(max_examples=examples(200))
@given(case=works())
def test_without_a_cpu_share_it_is_the_iteration_model(case):
    """No CPU share: the update the iteration sees is ``predict_iteration``'s beyond the compute
    (the device's share deferred, its part in device memory unhidden)."""
    work, rates, hidden_s = case
    work = SideWork(0, work.streamed, work.in_device_memory)
    compute_s = 1.0
    hbm_s = work.in_device_memory / rates.resident
    device_s = hbm_s + work.streamed / rates.streamed_alone
    want = predict_iteration(compute_s, device_s, device_s, 0.0, hidden_s, hbm_s) - compute_s
    assert overlapped_times(work, rates, hidden_s).visible_s == pytest.approx(want, rel=1e-9, abs=1e-12)


@st.composite
def choices(draw):
    n = draw(st.integers(1, 12))
    size = draw(st.integers(10**6, 10**8))
    sizes = [size] * n
    if draw(st.booleans()):
        sizes[-1] = draw(st.integers(1, size))  # partition's shorter last subgroup
    fixed = SideWork(draw(st.sampled_from([0, size])), draw(st.sampled_from([0, size])),
                     draw(st.sampled_from([0, size, 20 * size])))
    rates = SideRates(draw(rate), draw(rate), draw(rate), draw(rate), draw(rate))
    return sizes, fixed, rates, draw(st.floats(0.0, 1.0))


def visible_of(count, sizes, fixed, rates, hidden_s, overlap=True):
    """The visible update where the CPU takes ``count`` of ``sizes`` (spread's pick), independently summed."""
    on_cpu = sum(sizes[j] for j in spread(range(len(sizes)), count))
    work = SideWork(fixed.cpu + on_cpu, fixed.streamed + sum(sizes) - on_cpu, fixed.in_device_memory)
    return overlapped_times(work, rates, hidden_s, overlap).visible_s


@settings(max_examples=examples(300))
@given(case=choices())
def test_the_cpu_gets_a_share_exactly_where_it_is_predicted_shorter(case):
    sizes, fixed, rates, hidden_s = case
    n = len(sizes)
    choice = choose_overlapped_count(sizes, fixed, rates, hidden_s)
    every = [visible_of(k, sizes, fixed, rates, hidden_s) for k in range(n + 1)]
    assert choice.seconds == pytest.approx(every)
    least = min(every)
    assert every[choice.count] <= least * (1 + 1e-9)  # the least (float rounding aside)
    if choice.count:  # a share only where it is shorter than the device alone, beyond rounding
        assert every[0] > least * (1 + 1e-9)
    assert all(every[k] > least * (1 + 1e-9) for k in range(choice.count))  # the fewest of the best


@settings(max_examples=examples(200))
@given(case=choices(), forced=st.integers(0, 20))
def test_forced_shares_and_the_cpu_twin(case, forced):
    sizes, fixed, rates, hidden_s = case
    n = len(sizes)
    assert choose_overlapped_count(sizes, fixed, rates, hidden_s, forced=forced).count == min(forced, n)
    # Without rates measured beside each other only the single sides are priced.
    assert choose_overlapped_count(sizes, fixed, rates, hidden_s, side_by_side=False).count in (0, n)
    # The CPU twin runs the sides one after the other and hides nothing: the sum, hence one side.
    twin = choose_overlapped_count(sizes, fixed, rates, hidden_s, overlap=False)
    assert twin.count in (0, n)
    sums = [visible_of(k, sizes, fixed, rates, 0.0, overlap=False) for k in range(n + 1)]
    assert twin.seconds[twin.count] == pytest.approx(min(sums), rel=1e-9)


def test_the_20b_model_on_an_h200():
    """Figures of the 20.68 B overlapped runs (H200, 2026-11-26): 92 subgroups of 1e8 in HBM at 250
    G elem/s, 115 in host memory streamed at 8.23 G elem/s alone (7.16 beside the CPU), the CPU's one
    pass at 3.70 alone, the first forward 0.195 s (a quarter of 0.78 s of compute). Where the CPU
    keeps 3 G elem/s beside the streaming device it takes about a quarter of the host state and
    the visible update shrinks by about a fifth (1.24 -> 1.00 s); at the start-up probe's 0.20 G
    elem/s it takes none."""
    sizes, fixed = [10**8] * 115, SideWork(0, 0, 92 * 10**8)
    fast = SideRates(cpu_alone=3.7e9, cpu_beside=3.0e9, streamed_alone=8.23e9, streamed_beside=7.16e9, resident=250e9)
    choice = choose_overlapped_count(sizes, fixed, fast, 0.195)
    assert 25 <= choice.count <= 35
    assert choice.seconds[0] == pytest.approx(0.0368 + 11.5 / 8.23 - 0.195, abs=1e-3)  # 1.239 s, the device alone
    assert choice.seconds[choice.count] == pytest.approx(1.001, abs=1e-3)  # about a fifth less
    slow = SideRates(cpu_alone=3.7e9, cpu_beside=0.2e9, streamed_alone=8.23e9, streamed_beside=7.16e9, resident=250e9)
    assert choose_overlapped_count(sizes, fixed, slow, 0.195).count == 0
    # more of the device's share hidden, less for the CPU
    assert choose_overlapped_count(sizes, fixed, fast, 0.6).count < choice.count


# -- engines on the CPU twin ---------------------------------------------------------------------
NUMEL, SUB, STEPS = 24_000, 2_000, 4
KW = dict(lr=3e-3, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)
OPTIONS = dict(tiers=["host"], subgroup_size=SUB, adam_kernel="single", pin_memory=False, run_id="overlap-split",
               adam_elems_per_s=1e9, device_adam_elems_per_s=1e9, device_streamed_elems_per_s=1e9,
               device_chunk_elems=SUB // 2)


def all_cpu_state(init, grads):
    with OffloadedAdamW(init.clone(), OffloadConfig(update_on="cpu", **OPTIONS), **KW) as ref:
        for g in grads:
            ref.grad_buffer.copy_(g)
            ref.step()
        return engine_state(ref)


@pytest.mark.parametrize("share", [5, 12])
def test_a_deferred_engine_updates_its_cpu_share_in_the_step(share, caplog):
    """defer_device_wait on the CPU twin with the CPU's share given: the CPU updates that many host
    subgroups inside each step (its Adam timed in the step's record), the device the rest from the
    queue, and the state equals an all-CPU engine's bit for bit."""
    init = torch.randn(NUMEL, generator=torch.Generator().manual_seed(5))
    grads = bf16_grads(6, STEPS, NUMEL)
    want = all_cpu_state(init, grads)
    config = OffloadConfig(update_on="auto", defer_device_wait=True, cpu_share_subgroups=share, **OPTIONS)
    with caplog.at_level(logging.INFO, logger="mlp_offload"):
        with OffloadedAdamW(init.clone(), config, **KW) as eng:
            n = len(eng.subgroups)
            on = eng.placement.update_on
            assert on.count(CPU) == min(share, n) and on == [CPU if i in set(spread(range(n), min(share, n)))
                                                               else DEVICE for i in range(n)]
            records = []
            for g in grads:
                eng.settle()  # (a forward would have asked for every deferred subgroup's params)
                eng.grad_buffer.copy_(g)
                records.append(eng.step())
            # the forward's length changes nothing where the share is given
            assert eng.hide_under_forward(0.5) is None
            eng.settle()
            got = engine_state(eng)
    assert [(r.cpu_updated, r.device_updated) for r in records] == [(min(share, n), n - min(share, n))] * STEPS
    assert all(r.adam_s > 0 for r in records)
    lines = [r.getMessage() for r in caplog.records if "update split under the overlap" in r.getMessage()]
    assert len(lines) == 2 and all(f"cpu {min(share, n)} of {n} host-held subgroups (given)" in x for x in lines)
    assert "0.000 s hidden" in lines[0] and lines[1].endswith("0.500 s hidden under the forward); the sides stay")
    for w, g in zip(want, got):
        assert torch.equal(w, g)


def test_a_deferred_engine_gives_the_faster_cpu_the_host_state():
    """The model's own choice on the CPU twin (nothing hidden, the sides one after the other): with
    the CPU's Adam given ten times the device's streamed rate, all host-held subgroups go to the CPU
    (as the faster single side did before the model), and the state equals an all-CPU engine's."""
    init = torch.randn(NUMEL, generator=torch.Generator().manual_seed(7))
    grads = bf16_grads(8, STEPS, NUMEL)
    want = all_cpu_state(init, grads)
    options = dict(OPTIONS, adam_elems_per_s=1e12, device_streamed_elems_per_s=1e8)
    with OffloadedAdamW(init.clone(), OffloadConfig(update_on="auto", defer_device_wait=True, cpu_share_subgroups="auto", **options), **KW) as eng:
        assert eng.placement.update_on == [CPU] * len(eng.subgroups)
        for g in grads:
            eng.grad_buffer.copy_(g)
            assert eng.step().cpu_updated == len(eng.subgroups)
        got = engine_state(eng)
    for w, g in zip(want, got):
        assert torch.equal(w, g)


def test_the_cpu_share_field_is_checked():
    with pytest.raises(OffloadConfigError, match=r"cpu_share_subgroups=3\) .* needs defer_device_wait$"):
        OffloadConfig(tiers=["host"], update_on="auto", cpu_share_subgroups=3)
    with pytest.raises(OffloadConfigError, match=r"needs update_on 'auto', not 'device'"):
        OffloadConfig(tiers=["host"], update_on="device", defer_device_wait=True, cpu_share_subgroups=3)
    with pytest.raises(OffloadConfigError, match=r"whole number of subgroups >= 0, 'auto' or None, got -1"):
        OffloadConfig(tiers=["host"], update_on="auto", defer_device_wait=True, cpu_share_subgroups=-1)


def test_the_forward_s_length_re_chooses_the_share():
    """``Relocation.hide_under_forward`` on a real device: the start-up's count (nothing hidden) moves
    to the count the model picks for the forward's length, once; the same length again moves nothing."""
    n, size = 40, 10**8
    config = OffloadConfig(tiers=["host"], subgroup_size=size, update_on="auto", defer_device_wait=True,
                           cpu_share_subgroups="auto")
    subgroups = partition(n * size, size, config.state_codecs)
    rates = UpdateRates(cpu=3.7e9, device_resident=250e9, device_streamed=8.23e9, cpu_shared=3e9, streamed_shared=7.16e9)
    relocation = Relocation(subgroups, config, rates, "cuda")
    sides, start = overlapped_sides(subgroups, ["host"] * n, rates, 0.0, overlap=True)
    placement = Placement(["host"] * n, 0, 0, {"host": 0}, update_on=sides)
    want = choose_overlapped_count([size] * n, SideWork(), SideRates.from_start_up(rates), 0.2).count
    assert 0 < want < start.count
    plan = relocation.hide_under_forward(0.2, placement)
    assert plan.update_on.count(CPU) == want and plan.moves == {}
    assert f"cpu {want} of {n} host-held subgroups (chosen)" in plan.what and "0.200 s hidden" in plan.what
    placement.update_on = plan.update_on
    assert relocation.hide_under_forward(0.2, placement) is None


def test_the_flag_gives_the_share_and_its_errors_name_flags():
    from megatron.training.args.arguments import parse_args
    from megatron.training.errors import UserError
    from megatron.training.offload.flags import config_from_args

    base = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "32",
            "--micro-batch-size", "1", "--train-iters", "1", "--lr", "1e-3", "--mock-data", "--offload-tiers", "host",
            "--offload-update", "auto", "--offload-overlap-forward"]
    assert config_from_args(parse_args(base), 0).cpu_share_subgroups is None
    assert config_from_args(parse_args(base + ["--offload-cpu-share", "3"]), 0).cpu_share_subgroups == 3
    assert config_from_args(parse_args(base + ["--offload-cpu-share", "auto"]), 0).cpu_share_subgroups == "auto"
    with pytest.raises(UserError, match=r"^the CPU's share \(--offload-cpu-share 3\) splits the deferred update: "
                                        r"it needs --offload-overlap-forward$"):
        parse_args(base[:-1] + ["--offload-cpu-share", "3"])


# -- the CPU's rate from the steps (plan/overlap_steps.py) ---------------------------------------
H200 = UpdateRates(cpu=3.7e9, device_resident=250e9, device_streamed=8.23e9, cpu_shared=0.2e9, streamed_shared=7.16e9)


def deferred_relocation(n, size, rates=H200, device_type="cuda"):
    config = OffloadConfig(tiers=["host"], subgroup_size=size, update_on="auto", defer_device_wait=True,
                           cpu_share_subgroups="auto")
    subgroups = partition(n * size, size, config.state_codecs)
    sides, _ = overlapped_sides(subgroups, ["host"] * n, rates, 0.0, overlap=device_type != "cpu")
    return Relocation(subgroups, config, rates, device_type), Placement(["host"] * n, 0, 0, {"host": 0}, update_on=sides)


def record(step, sides, size, cpu_rate):
    """A deferred step's record: its CPU share's time at ``cpu_rate``."""
    cpu = sides.count(CPU)
    return StepRecord(step=step, update_s=0.01 + cpu * size / cpu_rate, adam_s=cpu * size / cpu_rate,
                      cpu_updated=cpu, device_updated=len(sides) - cpu)


def test_a_step_times_the_cpu_the_start_up_probe_undersold():
    """The H200's probe (0.20 G elem/s beside the device) gives the CPU nothing; one step with two
    subgroups shows 3 G elem/s, the share moves to the model's count at that rate, then to fewer
    once the forward hides 0.2 s, and steady steps at that rate move it no more."""
    n, size = 40, 10**8
    relocation, placement = deferred_relocation(n, size)
    assert placement.update_on.count(CPU) == 0
    probe = relocation.after_step(record(1, placement.update_on, size, 3e9), placement)
    assert probe.update_on == [CPU if i in set(spread(range(n), 2)) else DEVICE for i in range(n)]
    assert "cpu 2 of 40 host-held subgroups for one step, to time the CPU" in probe.what
    placement.update_on = probe.update_on
    # a re-placement between steps (the gpu tier fitted) keeps the probe's sides
    assert relocation.deferred.sides(placement.tier_of)[0] == probe.update_on
    learnt = relocation.after_step(record(2, placement.update_on, size, 3e9), placement)
    fast = SideRates.from_start_up(dataclasses.replace(H200, cpu_shared=3e9))
    want = choose_overlapped_count([size] * n, SideWork(), fast, 0.0).count
    assert learnt.update_on.count(CPU) == want > 2 and learnt.update_rates.cpu_shared == pytest.approx(3e9)
    assert "3 G elem/s beside the device" in learnt.what and "from the step (2 on the cpu)" in learnt.what
    placement.update_on = learnt.update_on
    hidden = relocation.hide_under_forward(0.2, placement)
    fewer = choose_overlapped_count([size] * n, SideWork(), fast, 0.2).count
    assert hidden.update_on.count(CPU) == fewer < want
    placement.update_on = hidden.update_on
    for step in range(3, 8):
        assert relocation.after_step(record(step, placement.update_on, size, 3e9), placement) is None


def test_a_slow_cpu_gives_its_share_back_and_is_not_timed_again():
    n, size = 40, 10**8
    relocation, placement = deferred_relocation(n, size)
    placement.update_on = relocation.after_step(record(1, placement.update_on, size, 0.2e9), placement).update_on
    back = relocation.after_step(record(2, placement.update_on, size, 0.2e9), placement)
    assert back.update_on == [DEVICE] * n
    placement.update_on = back.update_on
    for step in range(3, 6):
        assert relocation.after_step(record(step, placement.update_on, size, 0.2e9), placement) is None


@pytest.mark.parametrize("rates,device_type", [
    (H200, "cpu"),  # the CPU twin: nothing beside anything
    (dataclasses.replace(H200, cpu=0.3e9), "cuda"),  # even as fast beside the device as alone it gets nothing
    (dataclasses.replace(H200, streamed_shared=None), "cuda"),  # no rates measured side by side
])
def test_no_step_is_spent_timing_a_cpu_that_could_not_win(rates, device_type):
    n, size = 40, 10**8
    relocation, placement = deferred_relocation(n, size, rates, device_type)
    assert relocation.after_step(record(1, placement.update_on, size, 3e9), placement) is None
