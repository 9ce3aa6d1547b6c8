"""What a deferred step (``defer_device_wait``: the update under the next forward) leaves for the device: its
subgroups queued lazily in the next forward's order, each one's params event for the forward to wait on,
and the fences of its copies out handed to the next step."""

from __future__ import annotations

from typing import Callable, Dict, List, Optional, Sequence

import torch

from .device_side import Streams


class DeferredWork:
    """What a deferred step (``defer_device_wait``) leaves for the device: the subgroups still to
    queue, in the next forward's order, each queued one's params event, the fences to wait on
    before the host touches its state, and the span of the device's work (reported with the next
    step, once known).

    Queued lazily: a step queues ``ahead`` subgroups, and each ``need(i)`` (the forward reaching
    subgroup i's params) queues up to ``ahead`` past i. Queued all at once, a step's few thousand
    kernel launches overflowed CUDA's launch queue, and the host sat in the update until the device
    had drained it, for most of the device's update."""

    def __init__(self, streams: Streams, ahead: int = 4):
        self.streams = streams
        self.ahead = max(1, ahead)
        self.ready = {}  # per subgroup queued this step: its params' event
        self._todo: List[int] = []  # the step's subgroups in order; those before _next are queued
        self._position = {}
        self._next = 0
        self._launch: Optional[Callable[[int], object]] = None
        self._after_last: Optional[Callable[[dict], None]] = None
        self._fences = []
        self._written: Dict[int, object] = {}  # released fences not yet waited for, by subgroup
        self._start = None
        self._span = None
        self.last_seconds = 0.0  # the device time of the last settled step (taken once)

    def begin(self, order: Sequence[int], launch: Callable[[int], object],
              after_last: Optional[Callable[[dict], None]] = None) -> None:
        """A step's subgroups to update on the device, in order; ``launch(i)`` queues one and
        returns the fence of its last copy; ``after_last(fences)`` is called once the last is queued,
        with each subgroup's fence. Queues the first ``ahead`` now."""
        self.ready, self._fences, self._span = {}, [], None
        self._todo, self._next, self._launch, self._after_last = list(order), 0, launch, after_last
        self._position = {i: k for k, i in enumerate(self._todo)}
        self._start = self.streams.timed_mark(self.streams.compute)
        self._queue_until(self.ahead)

    @property
    def queued_count(self) -> int:
        return self._next

    def need(self, i: int):
        """Subgroup ``i``'s params event, queueing it (and ``ahead`` more) first where it is not yet;
        None where this step does not update it on the device."""
        k = self._position.get(i)
        if k is not None:
            self._queue_until(k + 1 + self.ahead)
        return self.ready.get(i)

    def keep_busy(self) -> None:
        """While the host does other work (the CPU's share): queue more where fewer than ``ahead``
        queued subgroups remain unfinished on the device. (The CPU twin's events are done at once:
        it queues nothing here, so its tests see the lazy order.)"""
        if not self.streams.cuda:
            return
        while self._next < len(self._todo):
            unfinished = sum(1 for i in self._todo[max(0, self._next - self.ahead):self._next]
                             if not self.ready[i].query())
            if unfinished >= self.ahead:
                return
            self._queue_until(self._next + 1)

    def _queue_until(self, count: int) -> None:
        while self._next < min(count, len(self._todo)):
            i = self._todo[self._next]
            self._next += 1
            self._fences.append((i, self._launch(i)))
            self.ready[i] = self.streams.record(self.streams.compute)
            if self._next == len(self._todo):  # the span ends with the last one queued
                self._span = (self._start, self.streams.timed_mark(self.streams.compute))
                if self._after_last is not None:
                    self._after_last(dict(self._fences))

    def settle(self) -> None:
        """Queue what is left, then wait for all of it (and for what ``release`` handed on)."""
        for fence in self.release().values():
            fence.synchronize()
        self._written = {}

    def release(self) -> Dict[int, object]:
        """Queue what is left and hand on, without waiting, each subgroup's fence: the copy out of its
        state, which may still run. The next step waits only where it touches that state (its copy in
        follows the fence on the device; the CPU synchronizes it before reading), so the device's copies
        out finish under the next step's start instead of holding the host. The fences stay in hand
        until a ``settle``."""
        self._queue_until(len(self._todo))
        fences, self._fences = self._fences, []
        self._written.update(fences)
        if self._span is not None:  # (its end follows the last params, which the forward waited for)
            self.last_seconds = self.streams.seconds_between(*self._span)
            self._span = None
        self._todo, self._next, self._position, self._launch = [], 0, {}, None
        return dict(self._written)

    def queue_rest(self) -> None:
        """Queue what no forward asked for (an expert without tokens), and make the caller's stream
        follow the device's compute: what reads the gradients after this (the norms) comes after the
        update's reads of them."""
        self._queue_until(len(self._todo))
        if self.streams.cuda:
            torch.cuda.current_stream().wait_stream(self.streams.compute)

    def take_seconds(self) -> float:
        seconds, self.last_seconds = self.last_seconds, 0.0
        return seconds

    def forget(self) -> None:
        """At close: a device-wide synchronize covers what is pending (nothing more is queued)."""
        self._fences, self._span, self._written = [], None, {}
        self._todo, self._next, self._position, self._launch = [], 0, {}, None
