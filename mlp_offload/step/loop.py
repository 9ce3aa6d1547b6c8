"""The step loop: one AdamW update over every subgroup, each through acquire -> side.update -> release.

The device's subgroups held in memory (gpu or host tier) go first, all of them: the device works
through them while the CPU runs its share (queued as the loop reached them, the device idled during
each CPU Adam). Deferred (``defer_device_wait``), they are handed to ``DeferredWork``, which queues
them as the next forward needs them. Then every other subgroup in the schedule's order: its state
where it is held, or read into a pipeline buffer; the side that updates it (``context.UpdateSide``);
its buffer back once the side's fence allows. A checkpoint writer's snapshot is guarded before each
update. The engine builds one loop at start-up and calls ``run`` each step; what surrounds a step
(settling, skipping, the next step's reads, the record's totals) stays in the engine.
"""

from __future__ import annotations

import time
from types import MappingProxyType
from typing import Callable, Dict, List, Mapping, Optional, Sequence, Tuple

from ..config import GPU_TIER
from .deferred import DeferredWork
from ..faults import fault_point
from ..pipeline import SlotPipeline, StateViews
from ..plan.placement import CPU, DEVICE, Placement
from ..plan.prediction import Prediction
from ..plan.schedule import StepSchedule
from .read_ahead import ReadAhead
from .context import Fence, StepContext, UpdateSide
from ..subgroups import Subgroup
from ..telemetry import StepRecord

InFlight = List[Tuple[int, Fence]]  # device-updated subgroups whose last copy may still run


class StepLoop:
    """Built once with what every step needs. ``placement`` is the engine's (changed in place between
    steps); ``prediction`` and ``before_update`` are asked each step, as the engine's change."""

    def __init__(self, subgroups: Sequence[Subgroup], placement: Placement,
                 cpu_side: UpdateSide, device_side: Optional[UpdateSide], pipeline: SlotPipeline,
                 resident: Dict[int, StateViews], deferred: Optional[DeferredWork],
                 read_ahead: Optional[ReadAhead], prediction: Callable[[], Prediction],
                 before_update: Callable[[int], None]):
        self.subgroups, self.placement = subgroups, placement
        self.cpu_side, self.device_side = cpu_side, device_side
        self.pipeline, self.resident = pipeline, resident
        self.deferred, self.read_ahead = deferred, read_ahead
        self.prediction, self.before_update = prediction, before_update

    def run(self, step: int, unscale, clip_coef, groups: Sequence[dict],
            written: Mapping[int, Fence] = MappingProxyType({})) -> StepRecord:
        """Update step ``step`` over every subgroup; its record (the caller adds the totals). A failure
        is stored on the pipeline: the engine refuses to go on after it. ``written``: per subgroup, the
        fence of the last deferred step's copy out of its state, which may still run (``DeferredWork.
        release``): a device update's copy in follows it, the CPU waits for it before reading."""
        sched, on = self.pipeline.schedule, self.placement.update_on
        ctx = self._context(step, unscale, clip_coef, groups, sched)
        self.cpu_side.begin(ctx, [i for i in sched.order if on[i] == CPU])
        if self.device_side is not None:
            self.device_side.begin(ctx)
        held = self.device_held_order(sched)
        if self.read_ahead is not None:
            self.read_ahead.keep_only(held)
        in_flight: InFlight = []

        def update(i, views):
            self.before_update(i)  # a checkpoint writer may still need it as it is
            fence = written.get(i)
            if on[i] == DEVICE:
                return self.device_side.update(i, views, fence)
            if fence is not None:
                fence.synchronize()
            return self.cpu_side.update(i, views)
        try:
            if self.deferred is not None:
                ctx.record.deferred_device_s = self.deferred.take_seconds()
                self.deferred.begin(held, lambda i: update(i, self.resident[i]), self.read_next_step_ahead)
            else:
                in_flight = [(i, update(i, self.resident[i])) for i in held]
            halfway = sched.order[len(sched.order) // 2]
            for i in sched.order:
                if i == halfway:
                    fault_point("update")
                if self.deferred is not None:
                    self.deferred.keep_busy()
                if on[i] == DEVICE and i in self.resident:
                    continue  # (above)
                views = self._acquire(i, in_flight, ctx.record)
                self._release(i, update(i, views), in_flight, ctx.record)
            self._finish_device(in_flight, ctx.record, keep=0)  # streamed buffers back to the pipeline
            if self.deferred is None and self.device_side is not None:
                self.device_side.end()
        except BaseException as err:
            self.pipeline.failure = err
            raise
        return ctx.record

    def device_held_order(self, sched: StepSchedule) -> List[int]:
        """The subgroups held in memory (gpu or host tier) the device updates, in the order it takes
        them: a deferred step in the next forward's order (descending), else the schedule's."""
        on = self.placement.update_on
        held = [i for i in sched.order if on[i] == DEVICE and i in self.resident]
        return sorted(held, reverse=True) if self.deferred is not None else held

    def read_next_step_ahead(self, written: Mapping[int, object]) -> None:
        """With a read-ahead: the next step's first host-held device subgroups copied in now, each after
        ``written[i]`` (the fence of the copy out that last wrote it, where one may still run)."""
        if self.read_ahead is None:
            return
        held = self.device_held_order(self.pipeline.schedule)
        picks = [(i, self.resident[i].narrow(self.subgroups[i].numel), written.get(i))
                 for i in held if self.placement.tier_of[i] != GPU_TIER]
        self.read_ahead.issue(picks)

    def _context(self, step: int, unscale, clip_coef, groups: Sequence[dict], sched: StepSchedule) -> StepContext:
        on, pred = self.placement.update_on, self.prediction()
        rec = StepRecord(step=step, streamed=len(sched.streamed), resident=len(self.resident),
                         predicted_update_s=pred.update_s, predicted_adam_s=pred.adam_s,
                         predicted_device_s=pred.device_s, device_updated=on.count(DEVICE),
                         cpu_updated=on.count(CPU))
        if self.deferred is not None:
            rec.predicted_deferred_s, rec.predicted_serial_s = pred.deferred_s, pred.serial_s
            rec.predicted_deferred_in_hbm_s = pred.deferred_in_hbm_s
        # copies: a deferred launch may come after the caller's scheduler changed the groups
        return StepContext(step, unscale, clip_coef, [dict(group) for group in groups], rec)

    def _acquire(self, i: int, in_flight: InFlight, rec: StepRecord) -> StateViews:
        """Subgroup ``i``'s state: where it is held, or read into a pipeline buffer (waiting for the
        device's streamed updates where the read needs a buffer they hold)."""
        if i in self.resident:
            views = self.resident[i]
            views.sync_fence()
            return views
        if i not in self.pipeline.slot_of:
            self._finish_device(in_flight, rec, keep=0)
        views, hit = self.pipeline.await_state(i, rec)
        rec.cache_hits += hit
        return views

    def _release(self, i: int, fence: Fence, in_flight: InFlight, rec: StepRecord) -> None:
        """After subgroup ``i``'s update was issued: a device update keeps its buffer until its fence
        (the device works on while the next is set up); a CPU one is done, its buffer goes back."""
        if self.placement.update_on[i] == DEVICE:
            in_flight.append((i, fence))
            self._finish_device(in_flight, rec, keep=1)
        elif i not in self.resident:
            self.pipeline.release(i)

    def _finish_device(self, pending: InFlight, rec: StepRecord, keep: int) -> None:
        """Wait for the oldest device updates until ``keep`` remain; their host buffers are then free."""
        while len(pending) > keep:
            i, fence = pending.pop(0)
            t0 = time.perf_counter()
            fence.synchronize()
            rec.device_s += time.perf_counter() - t0
            if i not in self.resident:
                self.pipeline.release(i)
