"""Performance model: per-tier time, devices shared by tiers, the cached probe."""

import json
import os

import pytest

import torch

from mlp_offload import OffloadedAdamW
from mlp_offload.config import OffloadConfig, TierBandwidth
from mlp_offload import probe_cache
from mlp_offload.perf_model import plan_placement, predict_update, probe_tier, tokens_for
from mlp_offload.subgroups import partition
from mlp_offload.tiers.files import FileTier
from mlp_offload.tiers.host import HostMemory

from .helpers import fast_config


def test_mixed_rate_used_only_when_it_beats_reads_then_writes():
    serial_only = TierBandwidth(2e9, 1e9)
    assert serial_only.seconds(2e9, 1e9) == 2.0
    overlapping = TierBandwidth(2e9, 1e9, mixed_bps=3e9)
    assert overlapping.seconds(2e9, 1e9) == 1.0
    slow_mixed = TierBandwidth(2e9, 1e9, mixed_bps=0.5e9)
    assert slow_mixed.seconds(2e9, 1e9) == 2.0


def _config(tmp_path):
    return OffloadConfig(tiers=["a", "b"], paths={"a": str(tmp_path), "b": str(tmp_path)}, subgroup_size=1000)


def test_tiers_on_one_device_share_its_time(tmp_path):
    subgroups = partition(20_000, 1000)
    rates = {"a": TierBandwidth(1e9, 1e9), "b": TierBandwidth(1e9, 1e9)}
    free = {"a": 1 << 40, "b": 1 << 40}
    apart = plan_placement(subgroups, _config(tmp_path), rates, free, {"a": 1, "b": 2})
    shared = plan_placement(subgroups, _config(tmp_path), rates, free, {"a": 1, "b": 1})
    t_apart = predict_update(subgroups, apart, rates, 1e12, 1e12, {"a": 1, "b": 2}).update_s
    t_shared = predict_update(subgroups, shared, rates, 1e12, 1e12, {"a": 1, "b": 1}).update_s
    assert t_shared > 1.8 * t_apart  # one device moves both tiers' bytes
    assert apart.tier_of.count("a") == apart.tier_of.count("b")


def test_ranks_sharing_a_device_multiply_its_time(tmp_path):
    # Each rank moves its own shard through the node's one device; the probe saw the device alone.
    subgroups = partition(20_000, 1000)
    rates = {"a": TierBandwidth(1e9, 1e9), "b": TierBandwidth(1e9, 1e9)}
    plan = plan_placement(subgroups, _config(tmp_path), rates, {"a": 1 << 40, "b": 1 << 40}, {"a": 1, "b": 1})
    alone = predict_update(subgroups, plan, rates, 1e12, 1e12, {"a": 1, "b": 1})
    four = predict_update(subgroups, plan, rates, 1e12, 1e12, {"a": 1, "b": 1}, ranks_sharing=4)
    moved = sum(alone.read_bytes.values()) + sum(alone.write_bytes.values())
    fill = alone.update_s - moved / 1e9  # the first read, not hidden; the same for one rank or four
    assert fill >= 0
    assert four.update_s == pytest.approx(4 * moved / 1e9 + fill)
    assert "shared by 4 ranks" in four.describe()
    # Compute-bound: the shared disk is not the limit, so sharing changes nothing.
    slow_adam = predict_update(subgroups, plan, rates, 1e3, 1e12, {"a": 1, "b": 1}, ranks_sharing=4)
    assert slow_adam.update_s == pytest.approx(slow_adam.adam_s)


def test_faster_tier_gets_more_subgroups(tmp_path):
    subgroups = partition(30_000, 1000)
    rates = {"a": TierBandwidth(3e9, 3e9), "b": TierBandwidth(1e9, 1e9)}
    plan = plan_placement(subgroups, _config(tmp_path), rates, {"a": 1 << 40, "b": 1 << 40}, {"a": 1, "b": 2})
    assert plan.tier_of.count("a") > 2 * plan.tier_of.count("b")


def test_probe_measures_three_phases_and_is_cached(tmp_path):
    tier = FileTier("nvme", str(tmp_path), "probe", 0, 64 * 1024, 2, op_threads=4)
    try:
        buf = HostMemory(None, pin=False).allocate(8 << 20, "probe")  # aligned, for O_DIRECT
        first = probe_tier(tier, buf)
        assert first.read_bps > 0 and first.write_bps > 0 and first.mixed_bps > 0
        with open(probe_cache.path_for(tier.root)) as f:
            assert json.load(f)["mixed_bps"] == first.mixed_bps
        assert probe_tier(tier, buf) == first  # served from the cache
        assert not [p for p in os.listdir(tier.dir) if p.startswith(".probe")]
    finally:
        tier.close()


@pytest.mark.parametrize("tiers,budget_slots", [(["nvme"], None), (["host", "nvme"], 5), (["host", "nvme"], 3)])
def test_predicted_bytes_match_what_the_engine_moves(tmp_path, tiers, budget_slots):
    # The model's bytes per step, against the engine's own traffic counters in steady state.
    sub, n_sub = 4096, 8  # page-aligned subgroups, the last one short: its turn in the cache alternates
    slot = 3 * sub * 4
    cfg = fast_config(tmp_path, tiers=tiers, subgroup_size=sub,
                      **({"host_budget_bytes": budget_slots * slot} if budget_slots else {}))
    eng = OffloadedAdamW(torch.zeros(sub * (n_sub - 1) + 1024), cfg, lr=1e-3)
    try:
        records = []
        for _ in range(22):
            eng.grad_buffer.normal_()
            records.append(eng.step())
        eng.flush()
        pred = eng.prediction
    finally:
        eng.close()
    # An even number of steps (both directions of the order); writes are counted as they complete,
    # so one may land in the next step's record: a long window keeps that within the tolerance.
    steady = records[2:]
    read = sum(r.tiers["nvme"].read_bytes for r in steady) / len(steady)
    written = sum(r.tiers["nvme"].write_bytes for r in steady) / len(steady)
    assert 0 < pred.read_bytes["nvme"] < 3 * slot * n_sub
    assert read == pytest.approx(pred.read_bytes["nvme"], rel=0.04)
    assert written == pytest.approx(pred.write_bytes["nvme"], rel=0.04)
    assert records[-1].cache_hits == pred.cache_hits


def test_tokens_follow_what_the_probe_saw_with_all_ranks_streaming():
    alone = dict(read_bps=2e9, write_bps=2e9, mixed_bps=2e9)
    assert tokens_for(TierBandwidth(**alone, shared_mixed_bps=2.7e9), 4) == 4  # scales: no turns
    assert tokens_for(TierBandwidth(**alone, shared_mixed_bps=1.9e9), 4) == 4  # flat: no turns
    assert tokens_for(TierBandwidth(**alone, shared_mixed_bps=1.0e9), 4) == 1  # thrashes: turns
    assert tokens_for(TierBandwidth(**alone), 4) == 1  # not probed (rates given): the design's default
    assert tokens_for(TierBandwidth(**alone, shared_mixed_bps=2.7e9), 1) == 1


def test_probe_with_ranks_sharing_measures_their_streams_too(tmp_path):
    tier = FileTier("t", str(tmp_path), "probe", 0, 64 * 1024, 2, op_threads=4)
    buf = HostMemory(None, pin=False).allocate(8 << 20, "probe", counted=False)
    try:
        alone = probe_tier(tier, buf, concurrency=2)
        shared = probe_tier(tier, buf, concurrency=2, ranks_sharing=3)
        cached = probe_tier(tier, buf, concurrency=2, ranks_sharing=3)
        assert [f for f in os.listdir(tier.dir) if f != "OWNER.json"] == []  # the probe's files are gone
    finally:
        tier.close()
    assert alone.shared_mixed_bps is None
    assert shared.shared_mixed_bps > 0 and shared.mixed_bps > 0
    assert cached == shared  # the second call read the cache of the first


@pytest.mark.parametrize("shared_bps,tokens", [(3e9, 2), (0.5e9, 1)])
def test_engine_takes_its_tokens_from_the_rates(tmp_path, shared_bps, tokens):
    rate = TierBandwidth(2e9, 2e9, 2e9, shared_mixed_bps=shared_bps)
    cfg = fast_config(tmp_path, tiers=["nvme"], bandwidths={"nvme": rate}, ranks_sharing_node=2)
    eng = OffloadedAdamW(torch.zeros(50_000), cfg, lr=1e-3)
    try:
        assert eng.tokens_per_tier == {"nvme": tokens}
        assert len(eng._tiers["nvme"].tokens._fds) == tokens  # the lock files ranks contend for
        # The node's I/O time: both ranks' bytes at the all-ranks rate, or one rank's time twice over.
        moved = eng.prediction.read_bytes["nvme"] + eng.prediction.write_bytes["nvme"]
        at_once = 2 * moved / shared_bps
        one_at_a_time = 2 * rate.seconds(eng.prediction.read_bytes["nvme"], eng.prediction.write_bytes["nvme"])
        assert eng.prediction.tier_s["nvme"] * 2 == pytest.approx(at_once if tokens == 2 else one_at_a_time)
    finally:
        eng.close()
    forced = fast_config(tmp_path, tiers=["nvme"], bandwidths={"nvme": rate}, ranks_sharing_node=2,
                         tokens_per_tier=3)
    eng = OffloadedAdamW(torch.zeros(50_000), forced, lr=1e-3)
    try:
        assert eng.tokens_per_tier == {"nvme": 3}
    finally:
        eng.close()


def test_a_tiny_probe_with_many_ranks_still_measures(tmp_path):
    tier = FileTier("t", str(tmp_path), "probe", 0, 64 * 1024, 2, op_threads=4)
    buf = HostMemory(None, pin=False).allocate(1 << 20, "probe", counted=False)
    try:
        rate = probe_tier(tier, buf, concurrency=2, ranks_sharing=512)  # more ranks than pages
    finally:
        tier.close()
    assert rate.shared_mixed_bps > 0
