"""Moving subgroups between tiers while the engine lives: the auto mode's device tier learns its
size from the device's real peak and promotes subgroups into spare memory, or hands them back to
lower tiers when memory grows tight (rather than let the training crash). ``device_change`` is the
policy (pure); ``Relocation`` moves the state, between steps, through the same tier calls the
checkpoints use. It also moves the update split between the CPU and the device (``plan.split``,
re-measured from each step's record) where ``update_on`` is "auto"."""

from __future__ import annotations

import logging
import math
from typing import Dict, Optional

from .config import GPU_TIER, HOST_TIER
from .tiers.kinds import kind_of
from .plan.placement import split_updates
from .plan.split import SideRates, UpdateSplit
from .units import GiB

log = logging.getLogger("mlp_offload")


def device_change(peak_bytes: int, capacity_bytes: int, margin_bytes: int, subgroup_bytes: int) -> int:
    """Subgroups to promote (> 0) or hand back (< 0): the spare device memory beyond the margin,
    in whole subgroups; a peak inside the margin hands back what brings it out again."""
    spare = capacity_bytes - peak_bytes - margin_bytes
    if spare >= 0:
        return spare // subgroup_bytes
    return -math.ceil(-spare / subgroup_bytes)


class Relocation:
    def __init__(self, engine):
        self.engine = engine
        rates, device = engine.update_rates, engine._device_update
        # The device and the CPU twin's "device" run at once only on a real device: on the CPU
        # they are the same cores, one after the other.
        # Deferred (defer_device_wait), a step's time is the host's share only: it cannot re-measure
        # the split, which then stays as start-up chose it (placement.split_updates).
        self.split = (UpdateSplit(SideRates.from_start_up(rates), overlap=device.device.type != "cpu")
                      if engine.config.update_on == "auto" and device is not None and rates.device_streamed
                      and not engine.config.defer_device_wait else None)

    def observe_step(self, rec) -> Optional[str]:
        """After each step: re-choose the update split from the rates the step showed; returns the
        line saying what changed (also logged), None if nothing did."""
        eng = self.engine
        if self.split is None:
            return None
        p = eng.placement
        change = self.split.observe(rec, [sg.numel for sg in eng.subgroups], p.tier_of, p.update_on)
        if change is None:
            return None
        p.update_on, what = change
        self._predict()
        what += f"; {eng.prediction.describe()}"
        log.info(what)
        return what

    def fit_device(self, peak_bytes: int, capacity_bytes: int) -> Optional[str]:
        eng = self.engine
        slot = max(sg.state_bytes for sg in eng.subgroups)
        change = device_change(peak_bytes, capacity_bytes, eng.config.gpu_margin_bytes, slot)
        tier_of = eng.placement.tier_of
        on_device = [i for i, t in enumerate(tier_of) if kind_of(t).in_device_memory]
        if change > 0:
            # Those streamed from files first (they save I/O too), then host-resident ones.
            below = ([i for i, t in enumerate(tier_of) if t in eng.file_tiers]
                     + [i for i, t in enumerate(tier_of) if t == HOST_TIER])
            moves = {i: GPU_TIER for i in below[:change]}
        elif change < 0:
            moves = {}
            for i in reversed(on_device[len(on_device) + change:] if -change < len(on_device) else on_device):
                dest = self._lower_home(eng.subgroups[i].state_bytes, moves)
                if dest is None:
                    log.warning("device memory is short by %.2f GiB but no lower tier has room for subgroup %d",
                                (peak_bytes + eng.config.gpu_margin_bytes - capacity_bytes) / GiB, i)
                    break
                moves[i] = dest
        else:
            return None
        if not moves:
            return None
        eng.settle()  # a deferred step's subgroups must be updated before they move
        self.move(moves)
        held = len([t for t in tier_of if kind_of(t).in_device_memory])
        what = (f"gpu tier auto: peak {peak_bytes / GiB:.2f} GiB of {capacity_bytes / GiB:.2f} GiB, margin "
                f"{eng.config.gpu_margin_bytes / GiB:.2f} GiB -> {'promoted' if change > 0 else 'handed back'} "
                f"{len(moves)} subgroup(s); the gpu tier holds {held} ({eng.memory[GPU_TIER].used_bytes / GiB:.2f} GiB); "
                f"{eng.prediction.describe()}")
        log.info(what)
        return what

    def _lower_home(self, nbytes: int, planned: Dict[int, str]) -> Optional[str]:
        """Where a subgroup leaving the device goes: host memory within its budget, else the file
        tier with the most free space."""
        eng = self.engine
        host = eng.memory[HOST_TIER]
        if eng.config.has_host:
            pending = sum(eng.subgroups[i].state_bytes for i, t in planned.items() if t == HOST_TIER)
            if host.budget_bytes is None or host.used_bytes + pending + nbytes <= host.budget_bytes:
                return HOST_TIER
        fits = [(tier.free_bytes(), name) for name, tier in eng.file_tiers.items() if tier.free_bytes() > nbytes]
        return max(fits)[1] if fits else None

    def move(self, moves: Dict[int, str]) -> None:
        """Give each subgroup in ``moves`` its new tier, state and all; then re-plan the update split
        and the prediction, and start the next step's reads."""
        self.engine.move_state(moves)
        self._replan()

    def _replan(self) -> None:
        eng = self.engine
        p = eng.placement
        for name in eng.memory:
            held = sum(eng.subgroups[i].state_bytes for i, t in enumerate(p.tier_of) if t == name)
            p.resident_bytes[name] = held + (p.slots * max(sg.state_bytes for sg in eng.subgroups)
                                             if name == HOST_TIER else 0)
        if self.split is not None and self.split.learnt:  # at the rates the steps showed
            p.update_on = self.split.plan([sg.numel for sg in eng.subgroups], p.tier_of)
        else:
            p.update_on = split_updates(eng.subgroups, p.tier_of, eng.config.update_on, eng.update_rates,
                                        eng.config.defer_device_wait)
        self._predict()
        eng.restart_reads()

    def _predict(self) -> None:
        """The engine's prediction for its placement and split, at the measured rates once there are some."""
        learnt = self.split is not None and self.split.learnt
        self.engine.repredict(self.split.rates.as_update_rates() if learnt else None)
