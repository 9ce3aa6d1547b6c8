"""Wall-clock timers of the training loop and megatron-core's schedule timers."""

from __future__ import annotations

import time

import torch


class Timers:
    """Wall-clock timers (CUDA-synchronized when on GPU), reset when read."""

    def __init__(self, device):
        self.device = device
        self.elapsed = {}
        self._start = {}

    def _sync(self):
        if self.device.type == "cuda":
            torch.cuda.synchronize()

    def start(self, name):
        self._sync()
        self._start[name] = time.perf_counter()

    def stop(self, name):
        self._sync()
        self.elapsed[name] = self.elapsed.get(name, 0.0) + time.perf_counter() - self._start.pop(name)

    def pop(self, name) -> float:
        return self.elapsed.pop(name, 0.0)


class ComputeTimers:
    """megatron-core's schedule-timer interface (``config.timers(name).start()/.stop()``): sums each
    name's intervals per iteration, e.g. 'forward-compute' and 'backward-compute' per micro-batch.
    On a GPU the intervals are CUDA events, read once per iteration, so timing adds no syncs."""

    def __init__(self, device):
        self.cuda = device.type == "cuda"
        self._open = {}
        self._closed = {}

    def __call__(self, name, log_level=0):
        return _TimerHandle(self, name)

    def _now(self):
        if not self.cuda:
            return time.perf_counter()
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def start(self, name):
        self._open[name] = self._now()

    def stop(self, name):
        self._closed.setdefault(name, []).append((self._open.pop(name), self._now()))

    def clear(self) -> None:
        self._closed.clear()

    def pop(self, name) -> float:
        spans = self._closed.pop(name, [])
        if self.cuda:
            if spans:
                spans[-1][1].synchronize()
            return sum(a.elapsed_time(b) for a, b in spans) / 1000.0
        return sum(b - a for a, b in spans)


class _TimerHandle:
    def __init__(self, timers: ComputeTimers, name: str):
        self.timers, self.name = timers, name

    def start(self, barrier=False):
        self.timers.start(self.name)

    def stop(self, barrier=False):
        self.timers.stop(self.name)
