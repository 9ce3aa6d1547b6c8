"""An optional timeline of the engine's work, written as a Chrome-trace JSON (Perfetto, chrome://tracing).

Complete ("X") events, one per piece of work: each subgroup's read and write on its tier (timed by
the I/O operation itself, token wait as its own event), and, on the compute lane, the update's
read waits, gradient conversion, Adam and the params callback. ``pid`` is the rank; ``tid`` a
lane: 0 is compute, each tier operation thread has its own (an operation thread runs one
operation at a time, so its events never overlap, as the format wants). ``args.tier`` names the
tier of every I/O event, for tools that draw one lane per tier (``tools/plot_timeline.py``).

Off unless ``OffloadConfig.trace_path`` is set; the engine then holds a ``Trace``, otherwise None
and no timing call is added anywhere.
"""

from __future__ import annotations

import json
import os
import threading
import time
from typing import Dict, List, Optional, Tuple

COMPUTE_LANE = 0


class Trace:
    """Thread-safe event list of one rank; ``save()`` writes it whole (to a temporary file, then
    renamed, so a reader never sees a half-written trace)."""

    def __init__(self, path: str, rank: int):
        self.path = path
        self.rank = rank
        # perf_counter is what the engine times with; anchor it to the wall clock once so the
        # traces of several ranks (or nodes with synchronized clocks) line up.
        self._origin_perf = time.perf_counter()
        self._origin_us = time.time_ns() / 1e3
        self._lock = threading.Lock()
        self._events: List[dict] = []
        self._lanes: Dict[Tuple[str, int], int] = {}  # (tier, worker thread id) -> tid
        self._lane_names: Dict[int, str] = {COMPUTE_LANE: "compute"}

    def _us(self, t: float) -> float:
        return round(self._origin_us + (t - self._origin_perf) * 1e6, 3)

    def compute(self, name: str, start: float, end: float, **args) -> None:
        """A phase of the update on the calling (training) thread; times from perf_counter."""
        self._add(name, "compute", COMPUTE_LANE, start, end, args)

    def io(self, tier: str, kind: str, key: str, start: float, busy_s: float, token_wait_s: float,
           nbytes: int) -> None:
        """One tier operation, called on its worker thread: ``start`` is when data began to move."""
        lane = self._lane(tier)
        if token_wait_s > 0:
            self._add("token wait", "token", lane, start - token_wait_s, start, {"tier": tier, "key": key})
        self._add(kind, kind, lane, start, start + busy_s, {"tier": tier, "key": key, "bytes": nbytes})

    def _lane(self, tier: str) -> int:
        ident = threading.get_ident()
        with self._lock:
            tid = self._lanes.get((tier, ident))
            if tid is None:
                tid = len(self._lane_names)
                self._lanes[(tier, ident)] = tid
                n = sum(1 for t, _ in self._lanes if t == tier)
                self._lane_names[tid] = f"{tier} io {n - 1}"
            return tid

    def _add(self, name: str, cat: str, tid: int, start: float, end: float, args: dict) -> None:
        event = {"name": name, "cat": cat, "ph": "X", "ts": self._us(start),
                 "dur": round(max(end - start, 0.0) * 1e6, 3), "pid": self.rank, "tid": tid, "args": args}
        with self._lock:
            self._events.append(event)

    def document(self) -> dict:
        with self._lock:
            events = list(self._events)
            names = dict(self._lane_names)
        meta = [{"name": "process_name", "ph": "M", "pid": self.rank, "tid": 0, "args": {"name": f"rank {self.rank}"}}]
        meta += [{"name": "thread_name", "ph": "M", "pid": self.rank, "tid": tid, "args": {"name": name}}
                 for tid, name in sorted(names.items())]
        return {"traceEvents": meta + events, "displayTimeUnit": "ms"}

    def save(self) -> None:
        tmp = f"{self.path}.tmp"
        parent = os.path.dirname(os.path.abspath(self.path))
        os.makedirs(parent, exist_ok=True)
        with open(tmp, "w") as f:
            json.dump(self.document(), f)
        os.replace(tmp, self.path)


def open_trace(path: Optional[str], rank: int) -> Optional[Trace]:
    return Trace(path, rank) if path else None
