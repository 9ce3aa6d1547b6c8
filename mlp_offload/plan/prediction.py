"""The predicted update time: the engine's own per-step schedule (``schedule.step_schedule``)
priced at the measured rates; printed beside every measured update."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Dict, Optional, Sequence

from ..config import TierBandwidth
from .device_share import device_share_seconds
from .placement import CPU, DEVICE, Placement, UpdateRates
from .schedule import step_schedule
from ..subgroups.partition import Subgroup
from ..tiers.kinds import kind_of


@dataclass
class Prediction:
    update_s: float
    adam_s: float  # the CPU's share: Adam and gradient conversion of the subgroups it updates
    device_s: float = 0.0  # the device's share: resident Adam plus streamed updates
    # Of the device's share, the subgroups held in memory (gpu or host tier): what a deferred step
    # (defer_device_wait) leaves queued under the next forward; the rest it waits for (serial_s).
    deferred_s: float = 0.0
    # Of deferred_s, the subgroups in device memory (gpu tier): HBM-bound kernels beside the forward's,
    # which they slow by about their own time instead of hiding under it (predict_iteration).
    deferred_in_hbm_s: float = 0.0
    serial_s: float = 0.0
    cpu_subgroups: int = 0
    device_subgroups: int = 0
    tier_s: Dict[str, float] = field(default_factory=dict)
    read_bytes: Dict[str, int] = field(default_factory=dict)
    write_bytes: Dict[str, int] = field(default_factory=dict)
    cache_hits: int = 0
    ranks_sharing: int = 1  # ranks of this node whose I/O goes to the same devices
    io_s: float = 0.0  # the file tiers' share: the busiest device's I/O (times the ranks sharing it), the first read

    def describe(self) -> str:
        tiers = " ".join(
            f"{t}:{self.read_bytes[t] / 1e9:.2f}GBr/{self.write_bytes[t] / 1e9:.2f}GBw/{s:.2f}s"
            for t, s in self.tier_s.items()
        )
        shared = f", each device shared by {self.ranks_sharing} ranks" if self.ranks_sharing > 1 else ""
        split = (f", split cpu {self.cpu_subgroups}/device {self.device_subgroups} subgroups, "
                 f"device {self.device_s:.3f}s" if self.device_subgroups else "")
        return (f"predicted update {self.update_s:.3f}s "
                f"(adam {self.adam_s:.3f}s{split}{', ' + tiers if tiers else ''}{shared})")


@dataclass(frozen=True)
class MeasuredRates:
    """The rates a placement is priced at: each file tier's bandwidth, the CPU's Adam and gradient
    conversion (elements/s), and the update sides' rates (``update``; None: the CPU's two alone)."""
    tiers: Dict[str, TierBandwidth]
    adam_elems_per_s: float
    convert_elems_per_s: float
    update: Optional[UpdateRates] = None


@dataclass(frozen=True)
class NodeSharing:
    """How this rank shares its file tiers on the node: each tier's device (tiers on one device add
    up; None: each its own), the ranks whose I/O goes to the same devices, and each tier's I/O tokens."""
    devices: Optional[Dict[str, object]] = None
    ranks: int = 1
    tokens: Optional[Dict[str, int]] = None


def predict_update(subgroups: Sequence[Subgroup], placement: Placement, measured: MeasuredRates,
                   sharing: NodeSharing = NodeSharing(), cache_alternating: bool = True,
                   interleaved: bool = True) -> Prediction:
    """Predicted steady-state update time: compute and each device's I/O overlap, the slowest wins.

    Tiers on one device add up (they share it); reads and writes of a device are counted one
    after the other, which matched a single disk closely. The node's
    ``sharing.ranks`` ranks move equal shards through the same paths in the same phase, so each
    device's time is multiplied by that count (data parallelism makes every rank wait for the
    node's slowest): at one rank's rate where they take turns (fewer ``sharing.tokens`` than ranks), at
    the probed all-ranks rate where they stream at once.

    Bytes come from ``schedule.step_schedule``, the traffic model the engine executes: hits skip
    their read, kept subgroups their write; the two order directions are averaged. The first
    streamed read after the hits is not hidden. ``interleaved``: the device's held subgroups are
    updated spread between each other on a GPU's streams (``device_share``); else in turn.
    """
    rates, update_rates = measured.tiers, measured.update
    adam_elems_per_s, convert_elems_per_s = measured.adam_elems_per_s, measured.convert_elems_per_s
    devices, ranks_sharing, tokens = sharing.devices, sharing.ranks, sharing.tokens
    sides = placement.update_on or [CPU] * len(subgroups)
    numel = sum(sg.numel for sg, side in zip(subgroups, sides) if side == CPU)
    streams = any(side == DEVICE and not kind_of(t).in_device_memory
                  for side, t in zip(sides, placement.tier_of))
    if update_rates is not None and update_rates.cpu_shared and streams:
        adam_s = numel / update_rates.cpu_shared  # beside the device's streaming (conversion included)
    else:
        adam_s = numel / adam_elems_per_s + numel / convert_elems_per_s
    held = [kind_of(t).resident for t in placement.tier_of]
    in_turn_s = device_seconds_of(subgroups, placement.tier_of, sides, update_rates)
    deferred_s = device_seconds_of(subgroups, placement.tier_of, sides, update_rates, only=held)
    device_s = in_turn_s - deferred_s + held_device_seconds(subgroups, placement.tier_of, sides, update_rates,
                                                            interleaved)
    in_hbm_s = device_seconds_of(subgroups, placement.tier_of, sides, update_rates,
                                 only=[kind_of(t).in_device_memory for t in placement.tier_of])
    # The engine's own schedule of the two order directions (steady state), averaged.
    both = [step_schedule(k, placement.tier_of, placement.slots, placement.cache_slots, cache_alternating)
            for k in (0, 1)]
    pred = Prediction(update_s=max(adam_s, device_s), adam_s=adam_s, device_s=device_s, deferred_s=deferred_s,
                      deferred_in_hbm_s=in_hbm_s, serial_s=max(adam_s, in_turn_s - deferred_s),
                      cpu_subgroups=sides.count(CPU), device_subgroups=sides.count(DEVICE),
                      cache_hits=len(both[0].hits))
    for tier in dict.fromkeys(t for t in placement.tier_of if not kind_of(t).resident):
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
        pred.io_s = ranks_sharing * busiest + fill
        pred.update_s = max(adam_s, device_s, pred.io_s)
        pred.serial_s = max(pred.serial_s, pred.io_s)
        pred.ranks_sharing = ranks_sharing
    return pred


def device_seconds_of(subgroups: Sequence[Subgroup], tier_of: Sequence[str], sides: Sequence[str],
                      rates: Optional[UpdateRates], only: Optional[Sequence[bool]] = None) -> float:
    """The device's share of the update (of the subgroups flagged in ``only``, if given): its resident
    subgroups at the resident rate, the streamed ones (host state copied in and out, overlapped with
    Adam) at the streamed rate, or at the rate measured beside the CPU's Adam where the CPU updates
    some subgroups too."""
    if rates is None or DEVICE not in sides:
        return 0.0
    streamed = rates.streamed_rate(cpu_works=CPU in sides)
    total = 0.0
    for k, (sg, tier, side) in enumerate(zip(subgroups, tier_of, sides)):
        if side == DEVICE and (only is None or only[k]):
            rate = rates.device_resident if kind_of(tier).in_device_memory else streamed
            total += sg.numel / rate if rate else 0.0
    return total


def held_device_seconds(subgroups: Sequence[Subgroup], tier_of: Sequence[str], sides: Sequence[str],
                        rates: Optional[UpdateRates], interleaved: bool) -> float:
    """The device's share of the subgroups held in memory (gpu tier in place, host tier streamed), as
    the step loop orders them (``device_share``)."""
    if rates is None or DEVICE not in sides:
        return 0.0
    on_device = [(sg.numel, kind_of(t)) for sg, t, side in zip(subgroups, tier_of, sides) if side == DEVICE]
    hbm = sum(n for n, kind in on_device if kind.in_device_memory)
    host = sum(n for n, kind in on_device if kind.resident and not kind.in_device_memory)
    return device_share_seconds(hbm, host, rates.device_resident, rates.streamed_rate(cpu_works=CPU in sides),
                                interleaved)


def device_seconds(tier_seconds: Dict[str, float], devices: Optional[Dict[str, object]]) -> Dict[object, float]:
    """Busy time per storage device: the tiers that share one add up."""
    total: Dict[object, float] = {}
    for tier, seconds in tier_seconds.items():
        key = devices[tier] if devices else tier
        total[key] = total.get(key, 0.0) + seconds
    return total


def first_forward_share(micro_batches: int, recompute_full: bool) -> float:
    """The first micro-batch's forward as a share of a step's compute (``predict_iteration``'s
    ``first_forward_s`` over ``compute_s``): the forward is a third of forward and backward, a quarter
    where the backward recomputes it, and the step runs ``micro_batches`` of them per rank."""
    return 1.0 / ((4 if recompute_full else 3) * max(1, micro_batches))


def predict_iteration(compute_s: float, update_s: float, deferred_s: float = 0.0, serial_s: float = 0.0,
                      first_forward_s: float = 0.0, in_hbm_s: float = 0.0) -> float:
    """One iteration: forward/backward (``compute_s``, measured without the update beside it) and the
    update. In series without the overlap (``deferred_s`` 0). With it (defer_device_wait) the step
    waits for its ``serial_s`` share only; the deferred device work runs under the next forward, which
    waits at each layer for that layer's params: the last layer's come when the deferred work ends,
    so only the first micro-batch's forward up to it (``first_forward_s``) hides the update, and the
    rest of the compute follows. (Nothing of the update runs under a backward.) Of the deferred work,
    ``in_hbm_s`` updates state held in device memory: bound by the same HBM and SMs as the forward, it
    lengthens the forward by its own time; only the streamed rest, bound by
    PCIe, hides.

    A read-ahead (``read_ahead``) is not credited: it moved the copies in under the backward but not
    the iteration, which the copies out of the whole streamed state bound."""
    if not deferred_s:
        return compute_s + update_s
    return serial_s + compute_s + in_hbm_s + max(0.0, deferred_s - in_hbm_s - first_forward_s)
