"""I/O performance model: measured rates in, placement and a predicted update time out.

Rates: each file tier's read/write bandwidth (a short probe through the tier's own I/O path,
cached per path) and the CPU Adam rate. Placement: how many subgroups stay resident in the host
budget, how many spare host buffers serve as pipeline and cache, and which file tier holds each
of the rest, chosen so that all file tiers finish their share at about the same time.
"""

from __future__ import annotations

import logging
import os
import time
from dataclasses import dataclass, field
from typing import Dict, List, Optional, Sequence

import torch

from . import probe_cache
from .config import HOST_TIER, OffloadConfig, TierBandwidth, probe_piece_bytes
from .schedule import step_schedule
from .subgroups import Subgroup
from .tiers.align import ALIGN, align_down
from .tiers.files import FileTier, fsync_path

log = logging.getLogger("mlp_offload")
GiB = 1024**3


class PlacementError(RuntimeError):
    """The state does not fit the given host budget and tier capacities."""


# -- rates -----------------------------------------------------------------------------------
def probe_tier(tier: FileTier, host_buffer: torch.Tensor, concurrency: int = 2,
               ranks_sharing: int = 1) -> TierBandwidth:
    """Write then read ``host_buffer`` through ``tier``, then both at once; cached in the tier directory.

    The buffer moves as ``concurrency`` files at once, as the engine keeps that many subgroup
    operations in flight, so the probe sees the bandwidth the pipeline can really get. Where
    ``ranks_sharing`` ranks of the node use the path, the mixed phase runs once more with that
    many times the streams and threads, as all of them would issue without turn-taking. A file
    lock serializes probes of one path, so ranks starting together neither disturb each other's
    measurement nor probe the same path more than once. A buffer too small to give each of the
    ``concurrency`` files two pages is an ``OffloadConfigError`` (see ``probe_piece_bytes``).
    """
    cache_path = probe_cache.path_for(tier.root)
    signature = {
        "bytes": host_buffer.numel(),
        "block_bytes": tier.block_bytes,
        "odirect": tier.odirect,
        "threads": tier.io_threads,
        "concurrency": concurrency,
        "ranks_sharing": ranks_sharing,
        # Bumped when what a phase measures changes, so older caches are measured again.
        "phases": "write,read,mixed" + (",shared" if ranks_sharing > 1 else "") + ",odirect-unflushed,whole-file-reads",
    }
    with probe_cache.node_lock(tier.root):  # node-local: no lock on a shared file system
        cached = probe_cache.read(cache_path, signature)
        if cached is not None:
            return cached
        piece = probe_piece_bytes(host_buffer.numel(), concurrency)
        parts = [(f".probe.{os.getpid()}.{k}", [(0, host_buffer[k * piece:(k + 1) * piece])])
                 for k in range(concurrency)]
        start = time.perf_counter()
        for f in [tier.submit_write(key, ext) for key, ext in parts]:
            f.result()
        _settle(tier, [key for key, _ in parts])
        write_s = time.perf_counter() - start
        start = time.perf_counter()
        for f in [tier.submit_read(key, ext) for key, ext in parts]:
            f.result()
        read_s = time.perf_counter() - start
        mixed_bps = _mixed_rate(tier, parts, piece, 1)
        shared_bps = None
        if ranks_sharing > 1:
            with tier.widened(ranks_sharing):
                shared_bps = _mixed_rate(tier, parts, piece, ranks_sharing)
        for key, _ in parts:
            tier.forget(key)
        nbytes = piece * concurrency
        result = TierBandwidth(read_bps=nbytes / read_s, write_bps=nbytes / write_s, mixed_bps=mixed_bps,
                               shared_mixed_bps=shared_bps)
        probe_cache.write(cache_path, signature, result, tier.name)
        return result


def _settle(tier: FileTier, keys) -> None:
    """Buffered writes sit in the page cache: fsync them, or the probe times memory copies.
    O_DIRECT writes are on the device when they return, as the engine's swap writes are (which it
    never fsyncs), so timing a flush there would charge the probe a cost the update never pays."""
    if not tier.odirect:
        for key in keys:
            fsync_path(tier.path_of(key))


def _mixed_rate(tier: FileTier, parts, piece: int, streams_each: int) -> float:
    """Bytes/s while files are read back and new ones written at once, as the update's read-ahead
    and write-behind do (many devices overlap the two). Each probe file's memory serves
    ``streams_each`` writes from its first half and as many reads into its second. Each read is
    of a whole file, written for it beforehand and not timed: a read of part of a file would end
    inside one of the tier's checksum blocks, and that block's checksum could not match."""
    half = align_down(piece // 2)
    streams_each = max(1, min(streams_each, half // ALIGN))  # a tiny probe: fewer, page-sized streams
    sub = align_down(half // streams_each)
    writes, sources = [], []
    for key, ext in parts:
        region = ext[0][1]
        for j in range(streams_each):
            writes.append((f"{key}.mixed{j}", [(0, region[j * sub:(j + 1) * sub])]))
            sources.append((f"{key}.source{j}", [(0, region[half + j * sub:half + (j + 1) * sub])]))
    for f in [tier.submit_write(key, ext) for key, ext in sources]:
        f.result()
    _settle(tier, [key for key, _ in sources])  # their flush must not land in the timed phase
    start = time.perf_counter()
    futures = [tier.submit_write(key, ext) for key, ext in writes]
    futures += [tier.submit_read(key, ext) for key, ext in sources]
    for f in futures:
        f.result()
    _settle(tier, [key for key, _ in writes])
    seconds = time.perf_counter() - start
    for key, _ in writes + sources:
        tier.forget(key)
    return 2 * len(writes) * sub / seconds


def measure_adam_rate(adam_step, numel: int = 1 << 24, repeats: int = 3) -> float:
    """Elements per second of the engine's Adam kernel on this CPU (best of ``repeats``).

    Measured at the subgroup size (capped), as the update runs it: small tensors would sit in the
    CPU caches and overstate the rate (it was 2x off at 4 M elements on the GPU machine).
    """
    params, grads, exp_avg, exp_avg_sq = (torch.empty(numel).fill_(v) for v in (0.5, 1e-3, 1e-4, 1e-6))
    best = float("inf")
    for i in range(repeats + 1):
        start = time.perf_counter()
        adam_step(params, grads, exp_avg, exp_avg_sq, step=i + 1)
        if i:  # the first call warms up threads and pages
            best = min(best, time.perf_counter() - start)
    return numel / best


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


# -- placement -------------------------------------------------------------------------------
@dataclass
class Placement:
    tier_of: List[str]  # per subgroup: "host" (resident) or a file tier name
    slots: int  # host buffers for streamed subgroups (pipeline + cache)
    cache_slots: int  # of those, kept across steps for the reversed order
    host_state_bytes: int  # resident state + slots, counted against the host budget

    def subgroups_on(self, tier: str) -> List[int]:
        return [i for i, t in enumerate(self.tier_of) if t == tier]


@dataclass
class Prediction:
    update_s: float
    adam_s: float
    tier_s: Dict[str, float] = field(default_factory=dict)
    read_bytes: Dict[str, int] = field(default_factory=dict)
    write_bytes: Dict[str, int] = field(default_factory=dict)
    cache_hits: int = 0
    ranks_sharing: int = 1  # ranks of this node whose I/O goes to the same devices

    def describe(self) -> str:
        tiers = " ".join(
            f"{t}:{self.read_bytes[t] / 1e9:.2f}GBr/{self.write_bytes[t] / 1e9:.2f}GBw/{s:.2f}s"
            for t, s in self.tier_s.items()
        )
        shared = f", each device shared by {self.ranks_sharing} ranks" if self.ranks_sharing > 1 else ""
        return (f"predicted update {self.update_s:.3f}s "
                f"(adam {self.adam_s:.3f}s{', ' + tiers if tiers else ''}{shared})")


def plan_placement(
    subgroups: Sequence[Subgroup],
    config: OffloadConfig,
    rates: Dict[str, TierBandwidth],
    free_bytes: Dict[str, int],
    devices: Optional[Dict[str, object]] = None,
) -> Placement:
    """Decide residency, slots and each streamed subgroup's file tier.

    ``devices`` maps each file tier to its storage device (e.g. ``st_dev``): tiers on one device
    share its bandwidth and its free space.
    """
    n = len(subgroups)
    slot_bytes = max(sg.state_bytes for sg in subgroups)
    file_tiers = config.file_tiers
    budget = config.host_budget_bytes
    total_state = sum(sg.state_bytes for sg in subgroups)

    if not file_tiers:
        if budget is not None and budget < total_state:
            raise PlacementError(
                f"host-only offload: the optimizer state needs {total_state / GiB:.3f} GiB but the "
                f"host budget is {budget / GiB:.3f} GiB (host_budget_bytes={budget}); raise "
                f"host_budget_bytes or add a file tier"
            )
        return Placement([HOST_TIER] * n, 0, 0, total_state)

    wanted_slots = config.prefetch_depth * len(file_tiers) + 1
    min_slots = 2  # one subgroup in the update while the next one is read
    if budget is None:
        budget = wanted_slots * slot_bytes  # no "host" tier: just the pipeline's buffers
    if budget < min_slots * slot_bytes:
        raise PlacementError(
            f"host budget {budget / GiB:.3f} GiB (host_budget_bytes={budget}) is below the pipeline's "
            f"minimum of {min_slots} subgroup buffers ({min_slots * slot_bytes / GiB:.3f} GiB at subgroup size "
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
        residents = min(n, (budget - pipeline_slots * slot_bytes) // slot_bytes)
    if residents >= n:
        return Placement([HOST_TIER] * n, 0, 0, total_state)
    resident_set = {(i * n) // residents for i in range(residents)} if residents else set()
    resident_bytes = sum(subgroups[i].state_bytes for i in resident_set)
    streamed = [i for i in range(n) if i not in resident_set]

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
    tier_of = [HOST_TIER] * n
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
    return Placement(tier_of, slots, cache_slots, resident_bytes + slots * slot_bytes)


def predict_update(
    subgroups: Sequence[Subgroup],
    placement: Placement,
    rates: Dict[str, TierBandwidth],
    adam_elems_per_s: float,
    convert_elems_per_s: float,
    devices: Optional[Dict[str, object]] = None,
    ranks_sharing: int = 1,
    tokens: Optional[Dict[str, int]] = None,
    cache_alternating: bool = True,
) -> Prediction:
    """Predicted steady-state update time: compute and each device's I/O overlap, the slowest wins.

    Tiers on one device add up (they share it); reads and writes of a device are counted one
    after the other, which matched a single disk within 10% (docs/benchmarks.md). The node's
    ``ranks_sharing`` ranks move equal shards through the same paths in the same phase, so each
    device's time is multiplied by that count (data parallelism makes every rank wait for the
    node's slowest): at one rank's rate where they take turns (fewer ``tokens`` than ranks), at
    the probed all-ranks rate where they stream at once.

    Bytes come from ``schedule.step_schedule``, the traffic model the engine executes: hits skip
    their read, kept subgroups their write; the two order directions are averaged. The first
    streamed read after the hits is not hidden.
    """
    numel = sum(sg.numel for sg in subgroups)
    adam_s = numel / adam_elems_per_s + numel / convert_elems_per_s
    # The engine's own schedule of the two order directions (steady state), averaged.
    both = [step_schedule(k, placement.tier_of, placement.slots, placement.cache_slots, cache_alternating)
            for k in (0, 1)]
    pred = Prediction(update_s=adam_s, adam_s=adam_s, cache_hits=len(both[0].hits))
    for tier in dict.fromkeys(t for t in placement.tier_of if t != HOST_TIER):
        pred.read_bytes[tier] = sum(subgroups[i].state_bytes for sched in both for i in sched.reads()
                                    if placement.tier_of[i] == tier) // 2
        pred.write_bytes[tier] = sum(subgroups[i].state_bytes for sched in both for i in sched.writes()
                                     if placement.tier_of[i] == tier) // 2
        rate = rates[tier]
        at_once = ranks_sharing > 1 and (tokens or {}).get(tier, 1) >= ranks_sharing
        if at_once and rate.shared_mixed_bps is not None:  # the node's bytes at the all-ranks rate
            pred.tier_s[tier] = (pred.read_bytes[tier] + pred.write_bytes[tier]) / rate.shared_mixed_bps
        else:
            pred.tier_s[tier] = rate.seconds(pred.read_bytes[tier], pred.write_bytes[tier])
    if pred.tier_s:
        # The first read after the hits is not hidden (as first computed: ascending, the descending step's hits).
        first = next((i for i in sorted(both[1].streamed) if i not in both[1].hits), None)
        fill = subgroups[first].state_bytes / rates[placement.tier_of[first]].read_bps if first is not None else 0.0
        busiest = max(device_seconds(pred.tier_s, devices).values())
        pred.update_s = max(adam_s, ranks_sharing * busiest + fill)
        pred.ranks_sharing = ranks_sharing
    return pred


def device_seconds(tier_seconds: Dict[str, float], devices: Optional[Dict[str, object]]) -> Dict[object, float]:
    """Busy time per storage device: the tiers that share one add up."""
    total: Dict[object, float] = {}
    for tier, seconds in tier_seconds.items():
        key = devices[tier] if devices else tier
        total[key] = total.get(key, 0.0) + seconds
    return total
