"""Moving subgroups between tiers while the engine lives: the auto mode's device tier learns its
size from the device's real peak and promotes subgroups into spare memory, or hands them back to
lower tiers when memory grows tight (rather than let the training crash). It also moves the update
split between the CPU and the device (``plan.split``, re-measured from each step's record) where
``update_on`` is "auto".

``device_change`` is the policy (pure); ``Relocation`` decides, from the placement and the room the
tiers have, and answers a ``RelocationPlan``: which subgroups move where, and the placement's new
update sides and bytes per memory tier. The engine applies it (between steps, through the same tier
calls the checkpoints use); this module holds no engine and changes no placement."""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass
from typing import Dict, List, Mapping, Optional, Sequence

from .config import GPU_TIER, HOST_TIER, OffloadConfig, TierBandwidth
from .config.units import GiB
from .plan.disk_rates import DiskRates
from .plan.overlap_steps import DeferredSteps
from .plan.placement import Placement, UpdateRates, split_updates
from .plan.split import SideRates, UpdateSplit
from .subgroups.partition import Subgroup, slot_subgroup
from .tiers.base import ResidentTier, StreamedTier
from .tiers.kinds import kind_of

log = logging.getLogger("mlp_offload")


def device_change(peak_bytes: int, capacity_bytes: int, margin_bytes: int, subgroup_bytes: int) -> int:
    """Subgroups to promote (> 0) or hand back (< 0): the spare device memory beyond the margin,
    in whole subgroups; a peak inside the margin hands back what brings it out again."""
    spare = capacity_bytes - peak_bytes - margin_bytes
    if spare >= 0:
        return spare // subgroup_bytes
    return -math.ceil(-spare / subgroup_bytes)


@dataclass(frozen=True)
class TierRoom:
    """The engine's tiers as a relocation sees them: its memory tiers by name, what the host can still
    take in bytes (None where the host holds no state; ``math.inf`` where its budget is unbounded) and
    each file tier's free bytes."""
    memory: Sequence[str]
    host: Optional[float]
    files: Dict[str, int]

    @classmethod
    def of(cls, memory: Mapping[str, ResidentTier], files: Mapping[str, StreamedTier], has_host: bool) -> "TierRoom":
        """The room of an engine's ``memory`` and file tiers now (``has_host``: the host holds state)."""
        host = memory[HOST_TIER]
        host_room = (None if not has_host else math.inf if host.budget_bytes is None
                     else host.budget_bytes - host.used_bytes)
        return cls(list(memory), host_room, {name: tier.free_bytes() for name, tier in files.items()})


@dataclass(frozen=True)
class RelocationPlan:
    """What the engine applies between steps, in this order: ``moves`` (subgroup -> its new tier; empty
    where only the split changes), then the placement's ``update_on`` and, where given, its
    ``resident_bytes``; the prediction priced anew at ``update_rates`` and ``tier_rates`` (None: the
    start-up's). ``what`` says what changed, in one line, without the new prediction (the engine adds it)."""
    moves: Dict[int, str]
    update_on: List[str]
    resident_bytes: Optional[Dict[str, int]]
    update_rates: Optional[UpdateRates]
    what: str
    tier_rates: Optional[Dict[str, TierBandwidth]] = None


class Relocation:
    """``device_type``: where the device update runs (None without one). ``update_rates``: the
    start-up's, the split's first guess and the prediction's rates until the steps show others.
    ``hold_split`` (default: the config's ``hold_update_split``): the update split stays as start-up chose it, whatever the steps' timings show (a
    deterministic run repeats its work, not only its bits); moves between tiers still re-side subgroups
    at the start-up's rates."""

    def __init__(self, subgroups: Sequence[Subgroup], config: OffloadConfig, update_rates: UpdateRates,
                 device_type: Optional[str], tier_rates: Optional[Dict[str, TierBandwidth]] = None,
                 hold_split: Optional[bool] = None):
        self.subgroups, self.config, self.update_rates = list(subgroups), config, update_rates
        hold_split = config.hold_update_split if hold_split is None else hold_split
        # A deferred step's measured time is only the share it waited for: no file tier's rate is read from it.
        self.disk = DiskRates(tier_rates) if tier_rates and not config.defer_device_wait else None
        # Deferred (defer_device_wait): the CPU's share of the host state, from the steps and the forward.
        self.deferred = (DeferredSteps(subgroups, config, update_rates, device_type not in (None, "cpu"), hold_split)
                         if config.defer_device_wait else None)
        # The device and the CPU twin's "device" run at once only on a real device: on the CPU
        # they are the same cores, one after the other.
        # Deferred (defer_device_wait), a step's time is the host's share only: it cannot re-measure
        # the split, which then stays as start-up chose it (placement.split_updates).
        self.split = (UpdateSplit(SideRates.from_start_up(update_rates, config.interleave_device_updates),
                                  overlap=device_type != "cpu", frozen=hold_split)
                      if config.update_on == "auto" and device_type is not None and update_rates.device_streamed
                      and not config.defer_device_wait else None)
        if hold_split and (self.split is not None or (self.deferred is not None and config.update_on == "auto")):
            log.info("update split held as start-up chose it (deterministic mode): the steps' timings do not move it")

    def after_step(self, rec, placement: Placement, prediction=None) -> Optional[RelocationPlan]:
        """After each step (priced by ``prediction``, where given): the update split re-chosen from the rates
        the step showed, and the file tiers' rates the prediction takes; None to keep both."""
        change = None
        if self.split is not None:
            change = self.split.observe(rec, [sg.numel for sg in self.subgroups], placement.tier_of,
                                        placement.update_on)
        elif self.deferred is not None:
            change = self.deferred.observe(rec, placement.tier_of, placement.update_on)
        disk = self.disk.observe(prediction, rec) if self.disk is not None and prediction is not None else None
        if change is None and disk is None:
            return None
        update_on, what = change if change is not None else (placement.update_on, None)
        return RelocationPlan({}, update_on, None, self._learnt_rates(), "; ".join(w for w in (what, disk) if w),
                              self._learnt_tier_rates())

    def hide_under_forward(self, hidden_s: float, placement: Placement) -> Optional[RelocationPlan]:
        """Deferred (``defer_device_wait``), once the forward's length is known: the CPU's share of the
        host-resident subgroups re-chosen where the forward hides ``hidden_s`` of the device's share
        (``plan.overlap_split``); None where the sides stay (or nothing is deferred)."""
        change = None if self.deferred is None else self.deferred.hide(hidden_s, placement.tier_of)
        if change is None:
            return None
        update_on, what = change
        if update_on == placement.update_on:
            log.info("%s; the sides stay", what)  # (the figures the forward's length gives, said once)
            return None
        return RelocationPlan({}, update_on, None, self._learnt_rates(), what, self._learnt_tier_rates())

    def fit_device(self, peak_bytes: int, capacity_bytes: int, placement: Placement,
                   room: TierRoom) -> Optional[RelocationPlan]:
        """The device tier fitted to the spare device memory: subgroups promoted into it or handed back
        to lower tiers (``room``); None where nothing moves."""
        margin = self.config.gpu_margin_bytes
        slot = slot_subgroup(self.subgroups).state_bytes
        change = device_change(peak_bytes, capacity_bytes, margin, slot)
        tier_of = placement.tier_of
        on_device = [i for i, t in enumerate(tier_of) if kind_of(t).in_device_memory]
        if change > 0:
            # Those streamed from files first (they save I/O too), then host-resident ones.
            below = ([i for i, t in enumerate(tier_of) if t in room.files]
                     + [i for i, t in enumerate(tier_of) if t == HOST_TIER])
            moves = {i: GPU_TIER for i in below[:change]}
        elif change < 0:
            moves = {}
            for i in reversed(on_device[len(on_device) + change:] if -change < len(on_device) else on_device):
                dest = self._lower_home(self.subgroups[i].state_bytes, moves, room)
                if dest is None:
                    log.warning("device memory is short by %.2f GiB but no lower tier has room for subgroup %d",
                                (peak_bytes + margin - capacity_bytes) / GiB, i)
                    break
                moves[i] = dest
        else:
            return None
        if not moves:
            return None
        after = [moves.get(i, t) for i, t in enumerate(tier_of)]
        resident = self._resident_bytes(after, placement, room.memory)
        held = len([t for t in after if kind_of(t).in_device_memory])
        what = (f"gpu tier auto: peak {peak_bytes / GiB:.2f} GiB of {capacity_bytes / GiB:.2f} GiB, margin "
                f"{margin / GiB:.2f} GiB -> {'promoted' if change > 0 else 'handed back'} "
                f"{len(moves)} subgroup(s); the gpu tier holds {held} ({resident.get(GPU_TIER, 0) / GiB:.2f} GiB)")
        return RelocationPlan(moves, self._sides(after), resident, self._learnt_rates(), what,
                              self._learnt_tier_rates())

    def _lower_home(self, nbytes: int, planned: Dict[int, str], room: TierRoom) -> Optional[str]:
        """Where a subgroup leaving the device goes: host memory within its budget, else the file
        tier with the most free space."""
        if room.host is not None:
            pending = sum(self.subgroups[i].state_bytes for i, t in planned.items() if t == HOST_TIER)
            if pending + nbytes <= room.host:
                return HOST_TIER
        fits = [(free, name) for name, free in room.files.items() if free > nbytes]
        return max(fits)[1] if fits else None

    def _resident_bytes(self, tier_of: Sequence[str], placement: Placement, memory: Sequence[str]) -> Dict[str, int]:
        """Each memory tier's bytes counted against its budget with ``tier_of`` (host: + the slots)."""
        slot = slot_subgroup(self.subgroups).state_bytes
        out = {}
        for name in memory:
            held = sum(self.subgroups[i].state_bytes for i, t in enumerate(tier_of) if t == name)
            out[name] = held + (placement.slots * slot if name == HOST_TIER else 0)
        return out

    def _sides(self, tier_of: List[str]) -> List[str]:
        """Each subgroup's update side with ``tier_of``: at the rates the steps showed, once there are some."""
        if self.split is not None and self.split.learnt:
            return self.split.plan([sg.numel for sg in self.subgroups], tier_of)
        deferred = None if self.deferred is None else self.deferred.sides(tier_of)
        if deferred is not None:
            return deferred[0]
        return split_updates(self.subgroups, tier_of, self.config.update_on, self.update_rates,
                             self.config.defer_device_wait)

    def _learnt_tier_rates(self) -> Optional[Dict[str, TierBandwidth]]:
        """The file tiers' rates a new prediction is priced at: those the steps showed, once there are some."""
        return self.disk.rates if self.disk is not None and self.disk.learnt else None

    def _learnt_rates(self) -> Optional[UpdateRates]:
        """The rates a new prediction is priced at: those the steps showed, once there are some."""
        if self.deferred is not None and self.deferred.learnt:
            return self.deferred.rates
        return self.split.rates.as_update_rates() if self.split is not None and self.split.learnt else None
