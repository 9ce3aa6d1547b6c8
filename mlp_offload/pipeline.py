"""The slot pipeline: host buffers ("slots") through which streamed subgroups move between their
file tier and the update, reads running ahead of it and writes behind.

A slot moves through these states:
  EMPTY/CLEAN -> READING (read in flight) -> READY (reserved for this step) -> updated ->
  WRITING (write in flight; reusable, a later read waits for it) or DIRTY (kept as cache for the
  reversed next step, whose first subgroups they are).
It follows the step's ``StepSchedule``: a subgroup still held in a buffer is used from memory
only where the schedule counts it a hit, so what the engine moves is what the prediction prices.
"""

from __future__ import annotations

import time
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Callable, Dict, List, Optional, Tuple

import torch

from .plan.schedule import StepSchedule
from .subgroups.partition import STATE_TENSORS, Subgroup
from .telemetry.traffic import StepRecord, TrafficCounters
from .tiers.base import StreamedTier
from .tiers.files import OpResult, TierIOError
from .telemetry.trace import Trace

EMPTY, READING, READY, DIRTY, WRITING = "empty", "reading", "ready", "dirty", "writing"


class OffloadStateError(RuntimeError):
    """The engine cannot continue: an earlier I/O failed. The message says what was kept."""


@dataclass
class StateViews:
    buf: torch.Tensor  # aligned uint8 buffer holding the three regions
    layout: Subgroup  # the subgroup it was sized for: where its regions lie in ``buf``
    param: torch.Tensor  # each in its stored format (layout.codecs)
    exp_avg: torch.Tensor
    exp_avg_sq: torch.Tensor
    fence: object = None  # returned by on_params_updated; synchronized before overwriting

    @classmethod
    def over(cls, buf: torch.Tensor, layout: Subgroup) -> "StateViews":
        views = [codec.view(buf[layout.region_offset(k):], layout.numel, layout.blocks)
                 for k, codec in enumerate(layout.codecs)]
        return cls(buf, layout, *views)

    def extents(self, sg: Subgroup) -> List[Tuple[int, torch.Tensor]]:
        """Its three regions as (file offset, host bytes) pairs in the subgroup's own file layout."""
        return [(sg.region_offset(k), self.buf[self.layout.region_offset(k): self.layout.region_offset(k)
                                               + sg.region_bytes(k)]) for k in range(len(STATE_TENSORS))]

    def sync_fence(self) -> None:
        if self.fence is not None:
            self.fence.synchronize()
            self.fence = None

    def narrow(self, sg: Subgroup) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Subgroup ``sg``'s stored tensors (the buffer may be sized for a larger one)."""
        return tuple(sg.narrow(k, t) for k, t in enumerate((self.param, self.exp_avg, self.exp_avg_sq)))


class _Slot:
    def __init__(self, index: int, views: StateViews):
        self.index = index
        self.views = views
        self.holder: Optional[int] = None  # subgroup whose state is (or is arriving) here
        self.state = EMPTY
        self.future: Optional[Future] = None
        self.pending_write: Optional[Future] = None  # a hit's own write, to finish before its update
        self.age = 0  # when it last became reusable, for LRU eviction


def file_key(i: int) -> str:
    return f"sg{i:06d}.state"


class ModelParamsAsMaster:
    """An initial-params fill function saying the masters start as the model's own bf16 params (as
    megatron-core starts its fp32 master). Stored as remainders, those are zeros by construction:
    no fp32 master is made and split (on a large model that cost much of the start-up)."""

    def __init__(self, fill: Callable[[int, int, torch.Tensor], None]):
        self.fill = fill

    def __call__(self, start: int, end: int, out: torch.Tensor) -> None:
        self.fill(start, end, out)


def starts_at_zero(source, sg: Subgroup) -> bool:
    """Whether ``fill_params(source, sg, ...)`` writes zeros: remainders of masters that start as the model's params."""
    return sg.codecs[0].needs_high and isinstance(source, ModelParamsAsMaster)


def fill_params(source, sg: Subgroup, out: torch.Tensor) -> None:
    """The initial fp32 master of a subgroup, from the caller's tensor or fill function, into
    ``out`` in its stored format. Stored as remainders: its low halves; the model holds the high
    halves (its bf16 params, which make remainders of zero)."""
    codec = sg.codecs[0]
    if starts_at_zero(source, sg):
        out.zero_()
        return
    if codec.needs_high:
        master = torch.empty(sg.numel, dtype=torch.float32)
        _fill_fp32(source, sg, master)
        codec.pack_(master, out, high=torch.empty(sg.numel, dtype=torch.bfloat16))
        return
    _fill_fp32(source, sg, out)  # copy_ rounds to a narrower float format as its codec packs


def _fill_fp32(source, sg: Subgroup, out: torch.Tensor) -> None:
    if callable(source):
        source(sg.start, sg.end, out)
    else:
        out.copy_(source[sg.start:sg.end])


@dataclass(frozen=True)
class IoLog:
    """Where the pipeline's I/O is recorded: byte and time totals per tier, and the trace (or None)."""
    counters: TrafficCounters
    trace: Optional[Trace] = None


class SlotPipeline:
    """Streams the subgroups placed on file tiers through ``buffers``, one step's schedule at a time."""

    def __init__(self, subgroups: List[Subgroup], tier_of: List[str], tiers: Dict[str, StreamedTier],
                 buffers: List[StateViews], prefetch_depth: int, initial_params, log: IoLog):
        self.subgroups = subgroups
        self.tier_of = tier_of
        self.tiers = tiers
        self.prefetch_depth = prefetch_depth
        self.counters = log.counters
        self.trace = log.trace
        self.slots = [_Slot(k, views) for k, views in enumerate(buffers)]
        self.slot_of: Dict[int, _Slot] = {}
        # Last write of each subgroup not yet known to be done: its next read must wait for it,
        # even when its buffer has since been reused for another subgroup.
        self.writes: Dict[int, Future] = {}
        # Streamed subgroups start "fresh": their first read copies the initial params, zeroes m, v.
        self.fresh = {i for i, t in enumerate(tier_of) if t in tiers}
        self.source = initial_params if self.fresh else None
        self.schedule: Optional[StepSchedule] = None
        self.failure: Optional[BaseException] = None
        self._age = 0
        self._cursor = 0
        self._inflight = {name: 0 for name in tiers}

    def begin(self, schedule: StepSchedule) -> None:
        """Follow ``schedule`` from now on; its first reads start at once."""
        self.schedule = schedule
        self._cursor = 0
        self.issue_reads()

    # -- the step --------------------------------------------------------------------------------
    def await_state(self, i: int, rec: StepRecord) -> Tuple[StateViews, bool]:
        """Subgroup ``i``'s state in a buffer, ready for the update; and whether it was a hit."""
        slot = self.slot_of.get(i)
        if slot is None or slot.state not in (READING, READY):
            self.issue_reads()
            slot = self.slot_of.get(i)
            if slot is None or slot.state not in (READING, READY):
                raise RuntimeError(f"internal: no buffer could be assigned to subgroup {i}")
        hit = slot.state == READY and slot.future is None
        if slot.pending_write is not None:
            t0 = time.perf_counter()
            self._wait_future(i, slot.pending_write)
            slot.pending_write = None
            t1 = time.perf_counter()
            rec.read_wait_s += t1 - t0
            if self.trace is not None:
                self.trace.compute("write wait", t0, t1, subgroup=i)
        if slot.state == READING:
            t0 = time.perf_counter()
            try:
                slot.future.result()
            except BaseException as err:
                raise self._read_failed(i, err) from err
            t1 = time.perf_counter()
            rec.read_wait_s += t1 - t0
            if self.trace is not None:
                self.trace.compute("read wait", t0, t1, subgroup=i, tier=self.tier_of[i])
            self._inflight[self.tier_of[i]] -= 1
            self.fresh.discard(i)
            if not self.fresh:
                self.source = None  # every subgroup is materialized: drop the caller's tensor
        slot.state, slot.future = READY, None
        self.issue_reads()
        return slot.views, hit

    def release(self, i: int) -> None:
        """After ``i``'s update: keep it (dirty) if the schedule says so, else write it behind."""
        slot = self.slot_of[i]
        self._age += 1
        slot.age = self._age
        if i in self.schedule.keep:
            slot.state = DIRTY
            return
        tier = self.tiers[self.tier_of[i]]
        slot.future = tier.submit_write(file_key(i), slot.views.extents(self.subgroups[i]),
                                        after=self._counted(tier.name, "write", file_key(i)))
        slot.state = WRITING
        self.writes[i] = slot.future
        self.issue_reads()

    def flush(self) -> None:
        """Wait until every write issued so far is on its tier (cached dirty ones stay in memory)."""
        for slot in self.slots:
            if slot.state == WRITING:
                self._wait_future(slot.holder, slot.future)
                slot.state, slot.future = EMPTY, None
        for i, future in list(self.writes.items()):
            self._wait_future(i, future)
        self.writes.clear()

    def issue_reads(self) -> None:
        """Issue reads in update order, up to ``prefetch_depth`` per tier, while buffers allow."""
        if self.schedule is None:
            return
        streamed = self.schedule.streamed
        while self._cursor < len(streamed):
            i = streamed[self._cursor]
            slot = self.slot_of.get(i)
            if slot is not None and slot.state in (READING, READY):
                self._cursor += 1  # already issued
                continue
            if slot is not None and slot.state in (DIRTY, WRITING, EMPTY) and i in self.schedule.hits:
                # Still in host memory from earlier (kept, or written but not yet reused): a hit.
                # A write still running must end before Adam changes the buffer, not now: waiting
                # here would put the last write-behind back into the update's critical path.
                slot.pending_write = slot.future if slot.state == WRITING else None
                slot.state = READY
                slot.future = None
                self._cursor += 1
                continue
            tier = self.tier_of[i]
            if self._inflight[tier] >= self.prefetch_depth:
                return
            if slot is None:
                slot = self._reusable_slot()
                if slot is None:
                    return
            # else: not a hit by the schedule (the cache is off): read back into the buffer that
            # holds its written copy, after that write.
            self._start_read(i, slot)
            self._cursor += 1

    # -- whole-state access (see state_access) -----------------------------------------------------
    def current_views(self, i: int) -> Optional[StateViews]:
        """The buffer holding ``i``'s current state, if any (a read in flight is waited for)."""
        slot = self.slot_of.get(i)
        if slot is not None and slot.state in (READING, READY, DIRTY):
            if slot.state == READING:
                # Left READING: the step that awaits it books the read (READY without a future
                # would count as a cache hit there).
                slot.future.result()
            return slot.views
        return None

    def newer_than_its_file(self, i: int) -> Optional[StateViews]:
        """The buffer holding ``i``'s state where its tier file may be older (kept unwritten, or a
        hit the next update changes in place), or where it has no file yet (its first
        materialization, waited for); None where the file is current. After ``flush()``."""
        slot = self.slot_of.get(i)
        if slot is not None and slot.state in (READY, DIRTY):
            return slot.views
        if i in self.fresh:
            return self.current_views(i)
        return None

    def fill_from_tier(self, i: int, views: StateViews) -> None:
        if i in self.fresh:
            self._materialize(i, views, lambda: None)
        else:
            tier = self.tiers[self.tier_of[i]]
            tier.submit_read(file_key(i), views.extents(self.subgroups[i])).result()

    def write_now(self, i: int, views: StateViews) -> None:
        """Store ``views`` as ``i``'s state on its tier; a copy left in a buffer is now stale."""
        tier = self.tiers[self.tier_of[i]]
        tier.submit_write(file_key(i), views.extents(self.subgroups[i])).result()
        self.fresh.discard(i)
        stale = self.slot_of.pop(i, None)
        if stale is not None:
            stale.holder = None

    def forget_buffers(self) -> None:
        """Drop every buffered copy (the state is about to be replaced); reads in flight finish."""
        for slot in self.slots:
            if slot.state == READING:
                slot.future.result()
            slot.state, slot.future, slot.holder, slot.pending_write = EMPTY, None, None, None
        self.slot_of.clear()
        self._inflight = {name: 0 for name in self.tiers}

    def persist_buffers(self) -> None:
        """Every subgroup's newest state onto its tier (kept ones and hits written now), then drop
        the buffered copies: for moving subgroups between tiers."""
        self.flush()
        for slot in list(self.slots):
            if slot.holder is not None and slot.state in (READY, DIRTY):
                self.write_now(slot.holder, slot.views)
        self.forget_buffers()

    def all_materialized(self) -> None:
        self.fresh.clear()
        self.source = None

    # -- internals ------------------------------------------------------------------------------
    def _reusable_slot(self) -> Optional[_Slot]:
        candidates = [s for s in self.slots if s.state in (EMPTY, WRITING)]
        if not candidates:
            return None
        # Prefer buffers that are already free, then the longest-reusable (its write is oldest).
        return min(candidates, key=lambda s: (s.state != EMPTY or s.holder is not None, s.age))

    def _start_read(self, i: int, slot: _Slot) -> None:
        previous_write, previous_views = slot.future if slot.state == WRITING else None, slot.views
        previous_holder = slot.holder
        if slot.holder is not None:
            self.slot_of.pop(slot.holder, None)
        sg = self.subgroups[i]
        tier = self.tiers[self.tier_of[i]]
        own_write = self.writes.pop(i, None)

        def buffer_free():
            # The buffer's last write must be done (if it failed, its data is still here and must
            # stay), and so must this subgroup's own last write (the file must be up to date).
            for j, write in ((previous_holder, previous_write), (i, own_write)):
                if write is not None:
                    try:
                        write.result()
                    except BaseException as err:
                        raise OffloadStateError(
                            f"writing subgroup {j} failed: {err}. Its state is still in host memory; "
                            f"the last checkpoint is intact") from err
            previous_views.sync_fence()

        if i in self.fresh:
            future = tier.submit(self._materialize, i, slot.views, buffer_free)
        else:
            future = tier.submit_read(file_key(i), slot.views.extents(sg), before=buffer_free,
                                      after=self._counted(tier.name, "read", file_key(i)))
        slot.holder, slot.state, slot.future = i, READING, future
        self.slot_of[i] = slot
        self._inflight[tier.name] += 1

    def _materialize(self, i: int, views: StateViews, buffer_free: Callable):
        buffer_free()
        sg = self.subgroups[i]
        param, exp_avg, exp_avg_sq = views.narrow(sg)
        fill_params(self.source, sg, param)
        exp_avg.zero_()
        exp_avg_sq.zero_()
        return None

    def _wait_future(self, i: int, future: Future) -> None:
        try:
            future.result()
        except BaseException as err:
            self.failure = err
            raise OffloadStateError(
                f"writing subgroup {i} failed: {err}. Its state is still in host memory; "
                f"the last checkpoint is intact") from err

    def _counted(self, tier: str, kind: str, key: str) -> Callable[[OpResult], None]:
        # Counted before the operation's future completes: once it is waited for (flush, a read
        # awaited), its bytes are in the counters. A done-callback could still be pending then.
        trace = self.trace
        if trace is None:
            return lambda result: self.counters.add(tier, kind, result)

        def count_and_trace(result: OpResult) -> None:
            self.counters.add(tier, kind, result)
            trace.io(tier, kind, key, result.start, result.busy_s, result.token_wait_s, result.nbytes)
        return count_and_trace

    def _read_failed(self, i: int, err: BaseException) -> BaseException:
        self.failure = err
        if isinstance(err, OffloadStateError):
            return err
        if isinstance(err, TierIOError):
            return OffloadStateError(f"subgroup {i}: {err}")
        return OffloadStateError(f"reading subgroup {i} from tier {self.tier_of[i]} failed: {err}")
