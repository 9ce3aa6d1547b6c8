"""Each distributed optimizer's engine config (an MoE model's dense and experts' engines): the host
and gpu budgets shared by the state each holds on the rank, the experts' own namespace and trace; a
host budget too small for either share refused in one line, against the engines' own plans."""

import dataclasses
import re

import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from tests.profiles import examples

from megatron.training.errors import UserError
from megatron.training.offload.options import flag_figure, in_flags
from megatron.training.offload.shard_budgets import check_host_split, config_for_kind
from mlp_offload import GiB, MeasuredRates, OffloadConfig, OffloadConfigError, PlacementError, TierBandwidth, plan_engine


@settings(max_examples=examples(50), deadline=None)
@given(st.integers(1, 10**9), st.integers(1, 10**9), st.integers(0, 10**11), st.integers(0, 10**9))
def test_budgets_are_shared_by_state_elements(dense, experts, host, gpu):
    config = OffloadConfig(tiers=["gpu", "host", "nvme"], paths={"nvme": "/nonexistent"}, host_budget_bytes=host,
                           gpu_budget_bytes=gpu, run_id="job7", trace_path="/tmp/trace.json")
    numels = {"dense": dense, "experts": experts}
    parts = {kind: config_for_kind(config, kind, numels) for kind in numels}
    assert parts["dense"].host_budget_bytes + parts["experts"].host_budget_bytes == host  # nothing lost to rounding
    assert parts["experts"].host_budget_bytes == host * experts // (dense + experts)
    assert parts["experts"].gpu_budget_bytes == gpu * experts // (dense + experts)
    assert parts["dense"].resolved_run_id() == "job7" and parts["experts"].resolved_run_id() == "job7.experts"
    assert parts["experts"].trace_path == "/tmp/trace.json.experts" and parts["dense"].trace_path == "/tmp/trace.json"


def test_one_engine_keeps_the_whole_config():
    config = OffloadConfig(tiers=["host"], host_budget_bytes=1 << 30)
    assert config_for_kind(config, "dense", {"dense": 5}) is config


RATES = {"nvme": TierBandwidth(2e9, 1e9)}


def engines_start(config, numels, budget):
    """The independent reference: each engine's own plan (the start-up's placement) at its share."""
    try:
        whole = dataclasses.replace(config, host_budget_bytes=budget)
        for kind, n in numels.items():
            plan_engine(n, config_for_kind(whole, kind, numels), MeasuredRates(RATES, 1e9, 1e9), {"nvme": 1 << 50}, 1)
    except (PlacementError, OffloadConfigError):  # a host-only share of 0 bytes: no config at all
        return False
    return True


@settings(max_examples=examples(60), deadline=None)
@given(st.integers(1, 300_000), st.integers(1, 300_000), st.integers(5_000, 400_000), st.booleans(),
       st.integers(0, 360))
def test_a_host_budget_too_small_for_either_engine_is_refused_in_one_line(dense, experts, subgroup, files, log_budget):
    """Refused exactly where an engine's placement would refuse its share; the line gives the budget
    as typed, its split, and a figure that starts both engines and is at most 1/1000 above the least."""
    budget = round(2 ** (log_budget / 10))  # 1 B to 64 GiB: an engine of few elements beside many needs a large whole
    tiers = ["host", "nvme"] if files else ["host"]
    config = OffloadConfig(tiers=tiers, paths={"nvme": "/nonexistent"} if files else {}, host_budget_bytes=budget,
                           subgroup_size=subgroup)
    numels = {"dense": dense, "experts": experts}
    if engines_start(config, numels, budget):
        check_host_split(config, numels)
        return
    with pytest.raises(UserError) as err:
        check_host_split(config, numels)
    line = str(err.value)
    assert "\n" not in line and line.startswith(f"--offload-host-cache-gb {flag_figure(budget, GiB)} is too small")
    experts_share = budget * experts // (dense + experts)
    for kind, share, n in (("dense", budget - experts_share, dense), ("experts", experts_share, experts)):
        figure, need = re.search(rf"{kind} ([0-9.e+-]+) GiB \({n} elements, needs ([0-9.e+-]+)\)", line).groups()
        assert float(figure) == pytest.approx(share / GiB, rel=5e-3)  # 3 significant digits or more
        if not engines_start(config, {kind: n}, share):  # an engine short of its share says so in figures
            assert float(figure) < float(need)
    suggested = int(float(re.search(r"; --offload-host-cache-gb ([0-9.]+) starts both", line).group(1)) * GiB)
    assert engines_start(config, numels, suggested)
    # and not much more than the least that starts both (1/1000: the figure keeps 4 significant digits, rounded up)
    assert not engines_start(config, numels, int(suggested / 1.001) - 1)
    assert ("lower --offload-subgroup-size" if files else "add a file tier") in line


def test_one_engine_or_no_host_budget_is_not_checked_here():
    tiny = OffloadConfig(tiers=["host", "nvme"], paths={"nvme": "/nonexistent"}, host_budget_bytes=1)
    check_host_split(tiny, {"dense": 10**6})  # the engine refuses it itself, naming the value typed
    unbounded = OffloadConfig(tiers=["host"], host_budget_bytes=None)
    check_host_split(unbounded, {"dense": 10**6, "experts": 10**6})


@settings(max_examples=examples(100), deadline=None)
@given(st.integers(1, 999_999), st.integers(-9, 2))
def test_a_budget_in_an_engine_message_reads_as_typed(mantissa, exponent):
    """The flag keeps int(GiB figure * GiB) bytes; the message shows the figure the user typed
    (up to 6 significant digits), not the bytes divided back (0.001 -> 0.000999999)."""
    typed = float(f"{mantissa}e{exponent}")
    assume(typed >= 1e-3)  # below, two figures of 6 digits can keep the same bytes
    line = in_flags(f"host budget (host_budget_bytes={int(typed * GiB)})")
    assert float(re.search(r"--offload-host-cache-gb ([0-9.e+-]+)\)", line).group(1)) == typed, line
