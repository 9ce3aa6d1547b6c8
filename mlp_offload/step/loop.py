"""The step loop: one AdamW update over every subgroup, each through acquire -> side.update -> release.

Each subgroup's update runs on the side the placement names (``context.UpdateSide``, one per value of
``placement.update_on``); the loop never asks which side it holds, only whether a side is
asynchronous. An asynchronous side's subgroups held in memory (gpu or host tier) go first, all of
them: it works through them while the host runs the rest (queued as the loop reached them).
Deferred (``defer_device_wait``), they are handed to ``DeferredWork``, which queues them as the next
forward needs them. Then every other subgroup in the schedule's order: its state where it is held,
or read into a pipeline buffer; its side's update; its buffer back once the side's fence allows. A
checkpoint writer's snapshot is guarded before each update. The engine builds one loop at start-up
and calls ``run`` each step; what surrounds a step (settling, skipping, the next step's reads, the
record's totals) stays in the engine.
"""

from __future__ import annotations

import time
from contextlib import ExitStack
from dataclasses import dataclass
from types import MappingProxyType
from typing import Callable, Dict, List, Mapping, Optional, Sequence, Tuple

from ..tiers.kinds import kind_of
from .deferred import DeferredWork
from ..faults import fault_point
from ..pipeline import SlotPipeline, StateViews
from ..plan.placement import CPU, DEVICE, Placement
from ..plan.prediction import Prediction
from ..plan.schedule import StepSchedule
from .read_ahead import ReadAhead
from .context import Fence, StepContext, UpdateSide
from ..subgroups.partition import Subgroup
from ..telemetry.traffic import StepRecord

InFlight = List[Tuple[int, Fence]]  # asynchronous updates whose last copy may still run


@dataclass(frozen=True)
class AcrossSteps:
    """The device's work that reaches past one step: ``deferred`` (``defer_device_wait``: the update
    left queued under the next forward) and ``read_ahead`` (the next step's copies in, begun early)."""
    deferred: Optional[DeferredWork] = None
    read_ahead: Optional[ReadAhead] = None


@dataclass(frozen=True)
class EngineHooks:
    """What the loop asks the engine each step: its ``prediction`` now (it changes as the engine
    re-plans) and ``before_update(i)``, the checkpoint writer's guard of subgroup i; ``interleave``:
    the order of the held subgroups (``interleaved``; the config's interleave_device_updates)."""
    prediction: Callable[[], Prediction]
    before_update: Callable[[int], None]
    interleave: bool = True


class StepLoop:
    """Built once with what every step needs. ``placement`` is the engine's (changed in place between
    steps); ``sides``: per value of its ``update_on``, the side that updates those subgroups;
    ``resident``: the views of the subgroups held in memory."""

    def __init__(self, subgroups: Sequence[Subgroup], placement: Placement, sides: Mapping[str, UpdateSide],
                 pipeline: SlotPipeline, resident: Dict[int, StateViews], across: AcrossSteps, hooks: EngineHooks):
        self.subgroups, self.placement, self.sides = subgroups, placement, dict(sides)
        self.pipeline, self.resident = pipeline, resident
        self.deferred, self.read_ahead = across.deferred, across.read_ahead
        self.hooks = hooks

    def run(self, step: int, unscale, clip_coef, groups: Sequence[dict],
            written: Mapping[int, Fence] = MappingProxyType({}), in_series: bool = False) -> StepRecord:
        """Update step ``step`` over every subgroup; its record (the caller adds the totals). A failure
        is stored on the pipeline: the engine refuses to go on after it. ``written``: per subgroup, the
        fence of the last deferred step's copy out of its state, which may still run (``DeferredWork.
        release``): a device update's copy in follows it, the CPU waits for it before reading. ``in_series``:
        a deferred step the caller waits for (``StepContext.in_series``)."""
        sched = self.pipeline.schedule
        ctx = self._context(step, unscale, clip_coef, groups, written, in_series)
        self._begin_sides(ctx, sched)
        try:
            with ExitStack() as windows:  # a paced checkpoint writer keeps out of the update's gaps
                for tier in self.pipeline.tiers.values():
                    windows.enter_context(tier.step_window())
                in_flight = self._update_held_first(ctx, sched)
                self._update_in_order(ctx, sched, in_flight)
                self._finish(in_flight, ctx.record, keep=0)  # streamed buffers back to the pipeline
                for side in self.sides.values():
                    side.end()
        except BaseException as err:
            self.pipeline.failure = err
            raise
        return ctx.record

    def held_first_order(self, sched: StepSchedule, in_series: bool = False) -> List[int]:
        """The subgroups held in memory (gpu or host tier) that an asynchronous side updates, in the
        order it takes them: a deferred step in the next forward's order (descending) unless the caller
        waits for it (``in_series``), else the schedule's, with the ones in device memory spread between
        the streamed ones (``interleaved``) unless the hooks' ``interleave`` is off."""
        held = [i for i in sched.order if i in self.resident and self._side_of(i).asynchronous]
        if self.deferred is not None and not in_series:
            return sorted(held, reverse=True)
        if not self.hooks.interleave:
            return held
        return interleaved(held, lambda i: kind_of(self.placement.tier_of[i]).in_device_memory)

    def read_next_step_ahead(self, written: Mapping[int, object]) -> None:
        """With a read-ahead: the next step's first host-held device subgroups copied in now, each after
        ``written[i]`` (the fence of the copy out that last wrote it, where one may still run)."""
        if self.read_ahead is None:
            return
        held = self.held_first_order(self.pipeline.schedule)
        picks = [(i, self.resident[i].narrow(self.subgroups[i]), written.get(i))
                 for i in held if not kind_of(self.placement.tier_of[i]).in_device_memory]
        self.read_ahead.issue(picks)

    # -- the steps of ``run`` ----------------------------------------------------------------------
    def _side_of(self, i: int) -> UpdateSide:
        return self.sides[self.placement.update_on[i]]

    def _begin_sides(self, ctx: StepContext, sched: StepSchedule) -> None:
        """Each side is told the step and its subgroups in update order."""
        on = self.placement.update_on
        for kind, side in self.sides.items():
            side.begin(ctx, [i for i in sched.order if on[i] == kind])

    def _update(self, side: UpdateSide, i: int, views: StateViews) -> Fence:
        self.hooks.before_update(i)  # a checkpoint writer may still need it as it is
        return side.update(i, views)

    def _update_held_first(self, ctx: StepContext, sched: StepSchedule) -> InFlight:
        """The asynchronous sides' subgroups held in memory, queued now (or handed to the deferral);
        their fences, where they are waited for in this step."""
        held = self.held_first_order(sched, ctx.in_series)
        if self.read_ahead is not None:
            self.read_ahead.keep_only(held)
        sides = {i: self._side_of(i) for i in held}  # (a deferred launch may come after a re-placement)
        if self.deferred is None:
            return [(i, self._update(sides[i], i, self.resident[i])) for i in held]
        ctx.record.deferred_device_s = self.deferred.take_seconds()
        self.deferred.begin(held, lambda i: self._update(sides[i], i, self.resident[i]), self.read_next_step_ahead)
        return []

    def _update_in_order(self, ctx: StepContext, sched: StepSchedule, in_flight: InFlight) -> None:
        """Every subgroup not taken first, in the schedule's order: acquired, updated, released."""
        first = set(self.held_first_order(sched))
        halfway = sched.order[len(sched.order) // 2]
        for i in sched.order:
            if i == halfway:
                fault_point("update")
            if self.deferred is not None:
                self.deferred.keep_busy()
            if i in first:
                continue
            side = self._side_of(i)
            views = self._acquire(i, in_flight, ctx.record)
            self._release(i, side, self._update(side, i, views), in_flight, ctx.record)

    def _context(self, step: int, unscale, clip_coef, groups: Sequence[dict], written: Mapping[int, Fence],
                 in_series: bool) -> StepContext:
        rec = self._record(step, self.pipeline.schedule)
        # copies: a deferred launch may come after the caller's scheduler changed the groups
        return StepContext(step, unscale, clip_coef, [dict(group) for group in groups], rec, written, in_series)

    def _record(self, step: int, sched: StepSchedule) -> StepRecord:
        """The step's record, with its counts and the prediction's figures."""
        on, pred = self.placement.update_on, self.hooks.prediction()
        rec = StepRecord(step=step, streamed=len(sched.streamed), resident=len(self.resident),
                         predicted_update_s=pred.update_s, predicted_adam_s=pred.adam_s,
                         predicted_device_s=pred.device_s, device_updated=on.count(DEVICE),
                         cpu_updated=on.count(CPU))
        if self.deferred is not None:
            rec.predicted_deferred_s, rec.predicted_serial_s = pred.deferred_s, pred.serial_s
            rec.predicted_deferred_in_hbm_s = pred.deferred_in_hbm_s
        return rec

    def _acquire(self, i: int, in_flight: InFlight, rec: StepRecord) -> StateViews:
        """Subgroup ``i``'s state: where it is held, or read into a pipeline buffer (waiting for the
        asynchronous updates where the read needs a buffer they hold)."""
        if i in self.resident:
            views = self.resident[i]
            views.sync_fence()
            return views
        if i not in self.pipeline.slot_of:
            self._finish(in_flight, rec, keep=0)
        views, hit = self.pipeline.await_state(i, rec)
        rec.cache_hits += hit
        return views

    def _release(self, i: int, side: UpdateSide, fence: Fence, in_flight: InFlight, rec: StepRecord) -> None:
        """After subgroup ``i``'s update was issued: an asynchronous side keeps its buffer until its
        fence (it works on while the next is set up); otherwise it is done, its buffer goes back."""
        if side.asynchronous:
            in_flight.append((i, fence))
            self._finish(in_flight, rec, keep=1)
        elif i not in self.resident:
            self.pipeline.release(i)

    def _finish(self, pending: InFlight, rec: StepRecord, keep: int) -> None:
        """Wait for the oldest asynchronous updates until ``keep`` remain; their host buffers are then free."""
        while len(pending) > keep:
            i, fence = pending.pop(0)
            t0 = time.perf_counter()
            fence.synchronize()
            rec.device_s += time.perf_counter() - t0
            if i not in self.resident:
                self.pipeline.release(i)


def interleaved(order: Sequence[int], in_device_memory: Callable[[int], bool]) -> List[int]:
    """``order`` with the subgroups in device memory spread evenly between the streamed ones (host
    state copied through the device), a streamed one first. The device's compute stream runs its
    work in the order queued: a run of in-HBM updates held the copies of the next streamed subgroup
    back behind them (two buffers), so the step took the sum of the in-HBM updates and the host link;
    spread, the link keeps copying while the compute stream works
    between two streamed subgroups."""
    streamed = [i for i in order if not in_device_memory(i)]
    resident = [i for i in order if in_device_memory(i)]
    if not streamed or not resident:
        return list(order)
    out, taken = [], 0
    for k, i in enumerate(streamed, 1):
        out.append(i)
        upto = (k * len(resident)) // len(streamed)
        out.extend(resident[taken:upto])
        taken = upto
    return out
