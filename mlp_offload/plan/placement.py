"""Placement policy, a pure function of measured rates, budgets and capacities: how many subgroups
stay resident in each memory tier (device memory first, then the host budget), how many spare host buffers serve as pipeline and cache, which
file tier holds each of the rest (so that all tiers finish their share at about the same time), and
how many I/O tokens a shared path gets, and where each subgroup's update runs (CPU or device)."""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Dict, List, Optional, Sequence

from ..config import GPU_TIER, HOST_TIER, OffloadConfig, TierBandwidth
from ..subgroups.partition import Subgroup, partition, slot_subgroup
from ..tiers.kinds import kind_of
from ..config.units import GiB

log = logging.getLogger("mlp_offload")


class PlacementError(RuntimeError):
    """The state does not fit the given host budget and tier capacities."""


MIN_PIPELINE_SLOTS = 2  # with file tiers: one subgroup in the update while the next one is read

# Below this fraction of one rank's mixed rate, the node's ranks streaming at once are taken to
# thrash the device, and they take turns instead.
THRASH_RATIO = 0.9


def tokens_for(rate: TierBandwidth, ranks_sharing: int) -> int:
    """I/O tokens for a tier path that ``ranks_sharing`` ranks of the node use.

    One token (ranks take turns) where the probe saw the device lose aggregate bandwidth when all
    of them stream at once, as spinning disks and busy shared file systems do; otherwise one per
    rank, since turn-taking then only leaves the device idle between turns (measured on a shared
    NVMe-class disk: docs/benchmarks.md). Without a shared-streams probe (rates given by the
    user), one token.
    """
    if ranks_sharing <= 1 or rate.shared_mixed_bps is None or rate.mixed_bps is None:
        return 1
    return ranks_sharing if rate.shared_mixed_bps >= THRASH_RATIO * rate.mixed_bps else 1


CPU, DEVICE = "cpu", "device"  # where a subgroup's update runs


@dataclass
class UpdateRates:
    """Elements per second of each way to update a subgroup, measured with the state's real dtypes."""

    cpu: float  # CPU Adam with the gradient conversion and the widening of narrow state
    device_resident: Optional[float] = None  # device Adam on state kept in device memory
    device_streamed: Optional[float] = None  # host state copied to the device and back, overlapped
    # The same two measured while both run at once, as a split step runs them: they share host
    # memory bandwidth and PCIe (the CPU's grads come down and its params go up over it). Timed
    # alone, the streamed rate was well above what split steps streamed (docs/design.md, "Placement").
    cpu_shared: Optional[float] = None
    streamed_shared: Optional[float] = None

    def cpu_rate(self, device_streams: bool) -> float:
        return self.cpu_shared if device_streams and self.cpu_shared else self.cpu

    def streamed_rate(self, cpu_works: bool) -> Optional[float]:
        return self.streamed_shared if cpu_works and self.streamed_shared else self.device_streamed


@dataclass
class Placement:
    tier_of: List[str]  # per subgroup: a resident tier ("gpu", "host") or a file tier name
    slots: int  # host buffers for streamed subgroups (pipeline + cache)
    cache_slots: int  # of those, kept across steps for the reversed order
    resident_bytes: Dict[str, int]  # per memory tier, counted against its budget (host: + slots)
    update_on: List[str] = field(default_factory=list)  # per subgroup: CPU or DEVICE

    @property
    def host_state_bytes(self) -> int:
        return self.resident_bytes.get(HOST_TIER, 0)

    def subgroups_on(self, tier: str) -> List[int]:
        return [i for i, t in enumerate(self.tier_of) if t == tier]

    def state_bytes_per_tier(self, subgroups: Sequence[Subgroup], file_tiers: Sequence[str]) -> Dict[str, int]:
        """Bytes of state each tier holds: a memory tier what its budget is charged, a file tier its
        subgroups' files."""
        held = dict(self.resident_bytes)
        for tier in file_tiers:
            held[tier] = sum(subgroups[i].state_bytes for i in self.subgroups_on(tier))
        return held


def spread(candidates: Sequence[int], count: int) -> List[int]:
    """``count`` of ``candidates`` spread evenly over them (so the other kind of work is never far)."""
    m = len(candidates)
    return [candidates[(k * m) // count] for k in range(count)] if count else []


def split_updates(subgroups: Sequence[Subgroup], tier_of: Sequence[str], mode: str,
                  rates: Optional[UpdateRates], deferred: bool = False) -> List[str]:
    """Where each subgroup's update runs. Device-resident ones on the device; the rest by ``mode``:
    all on the CPU, all on the device (streamed), or ``"auto"``: in update order each goes to the
    side that would finish its share soonest (list scheduling at the measured rates), so CPU and
    device each get the share that makes them end together. ``deferred`` (defer_device_wait): the
    device's work on state held in memory runs under the next forward while the CPU's share holds
    the step up, so host-held subgroups all go to the faster side alone, never split."""
    sides = [DEVICE if kind_of(t).in_device_memory else CPU for t in tier_of]
    if mode == "cpu":
        return sides
    if mode == "device":
        return [DEVICE] * len(tier_of)
    if rates is None or rates.device_streamed is None:
        return sides
    on_device = sum(subgroups[i].numel for i, t in enumerate(tier_of) if kind_of(t).in_device_memory)
    finish = {CPU: 0.0, DEVICE: on_device / (rates.device_resident or rates.device_streamed)}
    # A balanced split keeps both sides busy to the end: each is priced at its rate beside the other.
    cpu_rate, streamed_rate = rates.cpu_rate(device_streams=True), rates.streamed_rate(cpu_works=True)
    held_side = DEVICE if rates.device_streamed >= rates.cpu else CPU
    for i, t in enumerate(tier_of):
        if kind_of(t).in_device_memory:
            continue
        if deferred and kind_of(t).resident:
            sides[i] = held_side
            continue
        cost = {CPU: subgroups[i].numel / cpu_rate, DEVICE: subgroups[i].numel / streamed_rate}
        side = min((CPU, DEVICE), key=lambda s: finish[s] + cost[s])
        finish[side] += cost[side]
        sides[i] = side
    return sides


def plan_placement(
    subgroups: Sequence[Subgroup],
    config: OffloadConfig,
    rates: Dict[str, TierBandwidth],
    free_bytes: Dict[str, int],
    devices: Optional[Dict[str, object]] = None,
    update_rates: Optional[UpdateRates] = None,
    gpu_budget_bytes: Optional[int] = None,
) -> Placement:
    """Decide residency per memory tier, slots, each streamed subgroup's file tier and update side.

    ``devices`` maps each file tier to its storage device (e.g. ``st_dev``): tiers on one device
    share its bandwidth and its free space. ``gpu_budget_bytes`` overrides the config's (the auto
    mode's learnt size).
    """
    n = len(subgroups)
    slot_bytes = slot_subgroup(subgroups).state_bytes
    gpu_set = _gpu_resident(subgroups, config, gpu_budget_bytes)
    rest = [i for i in range(n) if i not in set(gpu_set)]
    placement = _place_below_device(subgroups, rest, config, rates, free_bytes, devices, slot_bytes)
    for i in gpu_set:
        placement.tier_of[i] = GPU_TIER
    if GPU_TIER in config.tiers:
        placement.resident_bytes = {GPU_TIER: sum(subgroups[i].state_bytes for i in gpu_set),
                                    **placement.resident_bytes}
    placement.update_on = split_updates(subgroups, placement.tier_of, config.update_on, update_rates,
                                        config.defer_device_wait)
    return placement


def _gpu_resident(subgroups: Sequence[Subgroup], config: OffloadConfig, gpu_budget_bytes: Optional[int]) -> List[int]:
    """The subgroups the device tier holds, spread over the update order."""
    if GPU_TIER not in config.tiers:
        return []
    n = len(subgroups)
    gpu_budget = config.budget_of(GPU_TIER) if gpu_budget_bytes is None else gpu_budget_bytes
    # Counted at the largest subgroup's size, so the set never exceeds the budget.
    return spread(range(n), min(n, gpu_budget // slot_subgroup(subgroups).state_bytes))


def _host_floor(subgroups: Sequence[Subgroup], rest: Sequence[int], config: OffloadConfig) -> int:
    """The least host budget for the subgroups ``rest`` below the device tier: all their state
    without a file tier, else the pipeline's minimum of buffers at the largest subgroup's size."""
    if not rest:
        return 0
    if not config.file_tiers:
        return sum(subgroups[i].state_bytes for i in rest)
    return MIN_PIPELINE_SLOTS * slot_subgroup(subgroups).state_bytes


def min_host_budget_bytes(numel: int, config: OffloadConfig, gpu_budget_bytes: Optional[int] = None) -> int:
    """The least ``host_budget_bytes`` a shard of ``numel`` elements starts with under ``config``
    (its own host budget aside): what ``plan_placement`` refuses below. 0 where the device tier
    holds it all."""
    subgroups = partition(numel, config.subgroup_size, config.state_codecs)
    gpu_set = set(_gpu_resident(subgroups, config, gpu_budget_bytes))
    return _host_floor(subgroups, [i for i in range(len(subgroups)) if i not in gpu_set], config)


def _place_below_device(subgroups: Sequence[Subgroup], rest: List[int], config: OffloadConfig,
                        rates: Dict[str, TierBandwidth], free_bytes: Dict[str, int],
                        devices: Optional[Dict[str, object]], slot_bytes: int) -> Placement:
    """Host residency, slots and file tiers for the subgroups the device tier does not hold."""
    n = len(subgroups)
    file_tiers = config.file_tiers
    budget = config.host_budget_bytes
    rest_state = sum(subgroups[i].state_bytes for i in rest)
    tier_of = [HOST_TIER] * n
    if not rest:
        return Placement(tier_of, 0, 0, {HOST_TIER: 0})
    if not file_tiers and not config.has_host:
        raise PlacementError(
            f"the optimizer state needs {sum(sg.state_bytes for sg in subgroups) / GiB:.3f} GiB but the gpu "
            f"budget holds only {(n - len(rest))} of {n} subgroups ({(n - len(rest)) * slot_bytes / GiB:.3f} GiB, "
            f"gpu_budget_bytes); raise gpu_budget_bytes or add {HOST_TIER!r} or a file tier")

    floor = _host_floor(subgroups, rest, config)
    if not file_tiers:
        if budget is not None and budget < floor:
            raise PlacementError(
                f"host-only offload: the optimizer state needs {rest_state / GiB:.3f} GiB but the "
                f"host budget is {budget / GiB:.3f} GiB (host_budget_bytes={budget}); raise "
                f"host_budget_bytes or add a file tier"
            )
        return Placement(tier_of, 0, 0, {HOST_TIER: rest_state})

    wanted_slots = config.prefetch_depth * len(file_tiers) + 1
    if budget is None:
        budget = wanted_slots * slot_bytes  # no "host" tier: just the pipeline's buffers
    if budget < floor:
        raise PlacementError(
            f"host budget {budget / GiB:.3f} GiB (host_budget_bytes={budget}) is below the pipeline's "
            f"minimum of {MIN_PIPELINE_SLOTS} subgroup buffers ({floor / GiB:.3f} GiB at subgroup size "
            f"{config.subgroup_size}); raise host_budget_bytes or lower subgroup_size"
        )
    pipeline_slots = min(wanted_slots, budget // slot_bytes)
    if pipeline_slots < wanted_slots:
        log.warning(
            "host budget allows %d subgroup buffers, fewer than prefetch depth %d x %d tiers + 1; "
            "prefetch will be shallower", pipeline_slots, config.prefetch_depth, len(file_tiers))

    # Residents: as many as fit beside the pipeline, spread evenly over the order so the update
    # always has CPU work while file reads are in flight.
    residents = 0
    if config.has_host:
        # Counted at the largest subgroup's size, so residents plus slots never exceed the budget.
        residents = min(len(rest), (budget - pipeline_slots * slot_bytes) // slot_bytes)
    if residents >= len(rest):
        return Placement(tier_of, 0, 0, {HOST_TIER: rest_state})
    resident_set = set(spread(rest, residents))
    resident_bytes = sum(subgroups[i].state_bytes for i in resident_set)
    streamed = [i for i in rest if i not in resident_set]

    # Spare budget becomes extra slots: each one caches a subgroup across the step boundary.
    slots = min((budget - resident_bytes) // slot_bytes, len(streamed) + pipeline_slots)
    cache_slots = max(0, min(slots - 1, len(streamed))) if config.cache_alternating else 0

    # Streamed subgroups go, in order, to the tier that would finish its share soonest:
    # greedy list scheduling, which also interleaves tiers so their reads overlap.
    sharing = config.resolved_ranks_sharing_node()
    device = devices or {t: t for t in file_tiers}
    finish = {device[t]: 0.0 for t in file_tiers}  # predicted busy time of each device
    used_dev = {device[t]: 0 for t in file_tiers}  # bytes placed on each device
    used = {t: 0 for t in file_tiers}
    for i in streamed:
        sg = subgroups[i]
        candidates = [t for t in file_tiers
                      if (used_dev[device[t]] + sg.state_bytes) * sharing <= free_bytes[t]]
        if not candidates:
            need = sum(subgroups[j].state_bytes for j in streamed) * sharing
            have = ", ".join(f"{t} {free_bytes[t] / GiB:.2f} GiB free" for t in file_tiers)
            raise PlacementError(
                f"not enough disk space for the offloaded state: {need / GiB:.2f} GiB needed on file "
                f"tiers ({sharing} rank(s) of this node), {have}; free space, add a tier path, or "
                f"raise host_budget_bytes"
            )
        cost = {t: rates[t].seconds(sg.state_bytes, sg.state_bytes) for t in candidates}
        # Ties (e.g. two paths on one device) go to the emptier tier, then the earlier one.
        best = min(candidates, key=lambda t: (finish[device[t]] + cost[t], used[t], file_tiers.index(t)))
        finish[device[best]] += cost[best]
        used_dev[device[best]] += sg.state_bytes
        used[best] += sg.state_bytes
        tier_of[i] = best
    return Placement(tier_of, slots, cache_slots, {HOST_TIER: resident_bytes + slots * slot_bytes})
