"""Performance model: per-tier time, devices shared by tiers, the cached probe."""

import json
import os
import tempfile
import time
from collections import Counter

import pytest
import torch
from hypothesis import example, given, settings
from hypothesis import strategies as st

from tests.profiles import examples

from mlp_offload import OffloadConfigError, OffloadedAdamW
from mlp_offload.config import OffloadConfig, TierBandwidth
from mlp_offload.plan import probe_cache
from mlp_offload.plan.placement import plan_placement, tokens_for
from mlp_offload.plan.prediction import MeasuredRates, NodeSharing, predict_update
from mlp_offload.plan.rates import probe_tier
from mlp_offload.plan.schedule import step_schedule
from mlp_offload.subgroups.partition import partition
from mlp_offload.tiers.files import FileIo, FileTier, TierOwner
from mlp_offload.tiers.host import HostMemory

from .helpers import fast_config
from .strategies import TIER_MIXES, fixed_setup, setups


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
    t_apart = predict_update(subgroups, apart, MeasuredRates(rates, 1e12, 1e12), NodeSharing({"a": 1, "b": 2})).update_s
    t_shared = predict_update(subgroups, shared, MeasuredRates(rates, 1e12, 1e12), NodeSharing({"a": 1, "b": 1})).update_s
    assert t_shared > 1.8 * t_apart  # one device moves both tiers' bytes
    assert apart.tier_of.count("a") == apart.tier_of.count("b")


def test_ranks_sharing_a_device_multiply_its_time(tmp_path):
    # Each rank moves its own shard through the node's one device; the probe saw the device alone.
    subgroups = partition(20_000, 1000)
    rates = {"a": TierBandwidth(1e9, 1e9), "b": TierBandwidth(1e9, 1e9)}
    plan = plan_placement(subgroups, _config(tmp_path), rates, {"a": 1 << 40, "b": 1 << 40}, {"a": 1, "b": 1})
    alone = predict_update(subgroups, plan, MeasuredRates(rates, 1e12, 1e12), NodeSharing({"a": 1, "b": 1}))
    four = predict_update(subgroups, plan, MeasuredRates(rates, 1e12, 1e12), NodeSharing({"a": 1, "b": 1}, ranks=4))
    moved = sum(alone.read_bytes.values()) + sum(alone.write_bytes.values())
    fill = alone.update_s - moved / 1e9  # the first read, not hidden; the same for one rank or four
    assert fill >= 0
    assert four.update_s == pytest.approx(4 * moved / 1e9 + fill)  # approx: float seconds summed in another order
    assert "shared by 4 ranks" in four.describe()
    # Compute-bound: the shared disk is not the limit, so sharing changes nothing.
    slow_adam = predict_update(subgroups, plan, MeasuredRates(rates, 1e3, 1e12), NodeSharing({"a": 1, "b": 1}, ranks=4))
    assert slow_adam.update_s == pytest.approx(slow_adam.adam_s)


def test_faster_tier_gets_more_subgroups(tmp_path):
    subgroups = partition(30_000, 1000)
    rates = {"a": TierBandwidth(3e9, 3e9), "b": TierBandwidth(1e9, 1e9)}
    plan = plan_placement(subgroups, _config(tmp_path), rates, {"a": 1 << 40, "b": 1 << 40}, {"a": 1, "b": 2})
    assert plan.tier_of.count("a") > 2 * plan.tier_of.count("b")


def test_probe_measures_three_phases_and_is_cached(tmp_path):
    tier = FileTier("nvme", str(tmp_path), TierOwner("probe", 0), FileIo(64 * 1024, 2, op_threads=4))
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


def _settled_counts(eng):
    """Bytes each tier moved since the last record, once all of the engine's I/O is done: writes
    flushed, reads in flight awaited (iter_state waits for them; its own reads are not counted)."""
    for _ in eng.iter_state():
        pass
    return eng.step(skip=True).tiers


def _implied_bytes(records, first_step, eng):
    """Per tier, what the steps' cache hits and the placement imply: a step reads its streamed
    subgroups but its hits (the first ones in its order: the previous step's tail, reversed), none
    in the first step (fresh state comes from the caller's tensor), and writes them but those it
    keeps in a buffer."""
    reads, writes = Counter(), Counter()
    tier_of = eng.placement.tier_of
    for step, rec in enumerate(records, first_step):
        sched = _schedule(eng, step)
        for i in sched.streamed[rec.cache_hits:] if step else []:
            reads[tier_of[i]] += eng.subgroups[i].state_bytes
        for i in sched.streamed:
            if i not in sched.keep:
                writes[tier_of[i]] += eng.subgroups[i].state_bytes
    return reads, writes


def _schedule(eng, step):
    return step_schedule(step, eng.placement.tier_of, eng.placement.slots, eng.placement.cache_slots,
                         eng.config.cache_alternating)


def _counted(traffic_dicts):
    reads, writes = Counter(), Counter()
    for tiers in traffic_dicts:
        for name, t in tiers.items():
            reads[name] += t.read_bytes
            writes[name] += t.write_bytes
    return reads, writes


def _original_case(tiers, budget_slots):
    # Page-aligned subgroups, the last one short: its turn in the cache alternates.
    return fixed_setup(tiers, 4096 * 7 + 1024, subgroup_size=4096,
                       host_budget_bytes=budget_slots and budget_slots * 3 * 4096 * 4)


@settings(max_examples=examples(100), deadline=None, derandomize=True, print_blob=True)
@given(setup=setups(tier_mixes=[m for m in TIER_MIXES if m != ["host"]], probe=False), pairs=st.integers(1, 2))
@example(setup=_original_case(["nvme"], None), pairs=1)
@example(setup=_original_case(["host", "nvme"], 5), pairs=1)
@example(setup=_original_case(["host", "nvme"], 3), pairs=1)
def test_engine_moves_the_bytes_its_hits_placement_and_prediction_imply(setup, pairs):
    """The engine's own traffic counters against its cache hits and placement (exactly), and
    against the model's bytes per step (each pair of steps runs both directions of the order)."""
    with tempfile.TemporaryDirectory() as root:
        eng = OffloadedAdamW(torch.zeros(setup.numel), setup.config(root), lr=1e-3)
        try:
            first = [eng.step() for _ in range(2)]
            first_tail = _settled_counts(eng)
            window = [eng.step() for _ in range(2 * pairs)]
            window_tail = _settled_counts(eng)
            pred = eng.prediction
            # The first two steps: every write; every read of step 1, and then those started
            # ahead for step 2 (a prefix of its non-hits on each tier, at most prefetch_depth).
            read, written = _counted([r.tiers for r in first] + [first_tail])
            want_read, want_written = _implied_bytes(first, 0, eng)
            assert written == want_written
            for tier in eng.config.file_tiers:
                ahead = [eng.subgroups[i].state_bytes for i in _schedule(eng, 2).streamed[window[0].cache_hits:]
                         if eng.placement.tier_of[i] == tier][:eng.config.prefetch_depth]
                assert read[tier] - want_read[tier] in {sum(ahead[:k]) for k in range(len(ahead) + 1)}, tier
            # From there on the read-ahead at both ends is the same (same direction, same state).
            read, written = _counted([r.tiers for r in window] + [window_tail])
            want_read, want_written = _implied_bytes(window, 2, eng)
            assert (read, written) == (want_read, want_written)
            for tier in eng.config.file_tiers:
                assert read[tier] == 2 * pairs * pred.read_bytes.get(tier, 0), tier
                assert written[tier] == 2 * pairs * pred.write_bytes.get(tier, 0), tier
            assert [r.cache_hits for r in first[1:] + window] == [pred.cache_hits] * (2 * pairs + 1)
        finally:
            eng.close()


def test_tokens_follow_what_the_probe_saw_with_all_ranks_streaming():
    alone = dict(read_bps=2e9, write_bps=2e9, mixed_bps=2e9)
    assert tokens_for(TierBandwidth(**alone, shared_mixed_bps=2.7e9), 4) == 4  # scales: no turns
    assert tokens_for(TierBandwidth(**alone, shared_mixed_bps=1.9e9), 4) == 4  # flat: no turns
    assert tokens_for(TierBandwidth(**alone, shared_mixed_bps=1.0e9), 4) == 1  # thrashes: turns
    assert tokens_for(TierBandwidth(**alone), 4) == 1  # not probed (rates given): the design's default
    assert tokens_for(TierBandwidth(**alone, shared_mixed_bps=2.7e9), 1) == 1


def test_probe_with_ranks_sharing_measures_their_streams_too(tmp_path):
    tier = FileTier("t", str(tmp_path), TierOwner("probe", 0), FileIo(64 * 1024, 2, op_threads=4))
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
        assert eng.file_tiers["nvme"].tokens.lock_files == tokens  # the lock files ranks contend for
        # The node's I/O time: both ranks' bytes at the all-ranks rate, or one rank's time twice over.
        moved = eng.prediction.read_bytes["nvme"] + eng.prediction.write_bytes["nvme"]
        at_once = 2 * moved / shared_bps
        one_at_a_time = 2 * rate.seconds(eng.prediction.read_bytes["nvme"], eng.prediction.write_bytes["nvme"])
        # approx: the prediction sums per-subgroup float seconds; this is one division
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
    tier = FileTier("t", str(tmp_path), TierOwner("probe", 0), FileIo(64 * 1024, 2, op_threads=4))
    buf = HostMemory(None, pin=False).allocate(1 << 20, "probe", counted=False)
    try:
        rate = probe_tier(tier, buf, concurrency=2, ranks_sharing=512)  # more ranks than pages
    finally:
        tier.close()
    assert rate.shared_mixed_bps > 0


@pytest.mark.parametrize("probe_bytes,block,depth,sharing", [
    (16 << 20, 8 << 20, 3, 1),  # as reported: each file one 8 MiB block, of which half was read
    (48 << 20, 8 << 20, 2, 1),  # as reported: the read ended inside the block at byte 8388608
    (48 << 20, 8 << 20, 2, 3),  # the all-ranks phase too
    ((1 << 20) + 12345, 12288, 5, 4),  # neither size a power of two
    (1 << 20, 4096, 128, 1),  # the smallest files: two pages each
])
def test_probe_reads_back_what_it_wrote_at_any_size(tmp_path, probe_bytes, block, depth, sharing):
    tier = FileTier("t", str(tmp_path), TierOwner("probe", 0), FileIo(block, 2, op_threads=depth + 2))
    buf = HostMemory(None, pin=False).allocate(probe_bytes, "probe", counted=False)
    try:
        rate = probe_tier(tier, buf, concurrency=depth, ranks_sharing=sharing)
    finally:
        tier.close()
    assert rate.read_bps > 0 and rate.write_bps > 0 and rate.mixed_bps > 0
    assert (rate.shared_mixed_bps is not None) == (sharing > 1)


def test_engine_probes_at_start_with_the_reported_settings(tmp_path):
    cfg = fast_config(tmp_path, tiers=["nvme"], prefetch_depth=3, probe_bytes=16 << 20,
                      io_block_bytes=8 << 20, bandwidths={})
    with OffloadedAdamW(torch.zeros(30_000), cfg) as eng:
        assert eng.rates["nvme"].mixed_bps > 0


def test_a_probe_too_small_for_its_files_names_the_settings(tmp_path):
    paths = {"nvme": str(tmp_path)}
    with pytest.raises(OffloadConfigError, match=r"probe_bytes=1048576 .*prefetch_depth=129.*1056768"):
        OffloadConfig(tiers=["nvme"], paths=paths, probe_bytes=1 << 20, prefetch_depth=129)
    # Nothing is probed where the rates are given.
    OffloadConfig(tiers=["nvme"], paths=paths, probe_bytes=1 << 20, prefetch_depth=129, bandwidths={"nvme": (1e9, 1e9)})
    tier = FileTier("t", str(tmp_path), TierOwner("probe", 0), FileIo(4096, 1, op_threads=2))
    try:
        with pytest.raises(OffloadConfigError, match="prefetch_depth=129"):
            probe_tier(tier, HostMemory(None, pin=False).allocate(1 << 20, "probe", counted=False), concurrency=129)
    finally:
        tier.close()


def test_a_probe_cached_before_the_whole_file_reads_is_measured_again(tmp_path):
    tier = FileTier("t", str(tmp_path), TierOwner("probe", 0), FileIo(64 * 1024, 2, op_threads=4))
    buf = HostMemory(None, pin=False).allocate(1 << 20, "probe", counted=False)
    old = {"bytes": 1 << 20, "block_bytes": 64 * 1024, "odirect": tier.odirect, "threads": 2, "concurrency": 2,
           "ranks_sharing": 1, "phases": "write,read,mixed,odirect-unflushed", "read_bps": 1.0, "write_bps": 1.0,
           "mixed_bps": 1.0, "shared_mixed_bps": None, "measured_at": time.time()}
    with open(probe_cache.path_for(tier.root), "w") as f:
        json.dump(old, f)
    try:
        rate = probe_tier(tier, buf)
    finally:
        tier.close()
    assert rate.read_bps != 1.0


def test_the_iteration_model_learns_compute_only_from_iterations_without_the_update_beside_them():
    """The compute alone is an iteration's time less its update where the step before it left
    nothing queued (settled, or not deferred); the prediction then follows predict_iteration."""
    from megatron.training.metrics.offload_figures import IterationModel
    from mlp_offload import StepRecord, predict_iteration

    model = IterationModel(micro_batches=2, recompute_full=False)  # first forward: 1/6 of the compute

    def record(step, settled, update_s=0.1):
        return StepRecord(step=step, update_s=update_s, predicted_update_s=0.5, predicted_deferred_s=0.4,
                          predicted_serial_s=0.1, settled=settled)
    assert model.observe(9.0, record(1, True), first_of_run=True) is None  # the first iteration teaches nothing
    assert model.observe(2.1, record(2, True), first_of_run=False) is None  # after a settled step: 2.0 alone
    assert model.compute_s == 2.0
    assert model.observe(2.6, record(3, False), first_of_run=False) == predict_iteration(2.0, 0.5, 0.4, 0.1, 2.0 / 6)
    assert model.compute_s == 2.5  # the previous step was settled: still alone
    model.observe(3.5, record(4, False), first_of_run=False)
    assert model.compute_s == 2.5  # the update ran beside it: not a compute sample
    # deferred work beyond the first forward adds to the compute; none: compute plus update in series
    assert predict_iteration(2.0, 0.5, 0.4, 0.1, 0.1) == pytest.approx(0.1 + 2.0 + 0.3, rel=1e-12)  # float sums
    assert predict_iteration(2.0, 0.5) == 2.5
    # deferred work on state in device memory runs beside the forward and lengthens it by its own time
    assert predict_iteration(2.0, 0.5, 0.4, 0.1, 0.1, in_hbm_s=0.15) == pytest.approx(0.1 + 2.0 + 0.15 + 0.15,
                                                                                        rel=1e-12)
    assert predict_iteration(2.0, 0.5, 0.4, 0.1, 0.3, in_hbm_s=0.4) == pytest.approx(0.1 + 2.0 + 0.4, rel=1e-12)
