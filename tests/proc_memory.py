"""Memory of a process tree as the kernel counts it: the summed PSS (proportional set size, from
/proc/<pid>/smaps_rollup) of a process and all its descendants. A page shared by n processes counts
1/n in each, so the sum is what the tree costs the node; a copy-on-write copy counts in full."""

from __future__ import annotations

import os
import threading
import time
from typing import List, Optional


def descendants(pid: int) -> List[int]:
    """``pid`` and every live process below it (children read from /proc/<pid>/task/*/children)."""
    found, todo = [], [pid]
    while todo:
        p = todo.pop()
        found.append(p)
        try:
            for task in os.listdir(f"/proc/{p}/task"):
                with open(f"/proc/{p}/task/{task}/children") as f:
                    todo.extend(int(c) for c in f.read().split())
        except OSError:  # gone meanwhile
            continue
    return found


def pss_bytes(pid: int) -> int:
    try:
        with open(f"/proc/{pid}/smaps_rollup") as f:
            for line in f:
                if line.startswith("Pss:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def tree_pss_parts(pid: int) -> List[tuple]:
    """(pid, its PSS) of each process of ``pid``'s tree."""
    return [(p, pss_bytes(p)) for p in descendants(pid)]


def tree_pss_bytes(pid: Optional[int] = None) -> int:
    return sum(b for _, b in tree_pss_parts(os.getpid() if pid is None else pid))


class PeakSampler:
    """The highest ``tree_pss_bytes(pid)`` seen, sampled every ``interval_s`` in a thread; ``at_peak()`` says
    which processes held it (for a test's message: where a peak above the plan lives)."""

    def __init__(self, pid: int, interval_s: float = 0.2):
        self.pid, self.interval_s, self.peak = pid, interval_s, 0
        self.peak_parts: List[tuple] = []  # (pid, its PSS) of each process of the tree at the peak
        self.peak_after_s = 0.0
        self._started = time.monotonic()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self):
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()

    def _run(self):
        while not self._stop.is_set():
            parts = tree_pss_parts(self.pid)
            total = sum(b for _, b in parts)
            if total > self.peak:
                self.peak, self.peak_parts, self.peak_after_s = total, parts, time.monotonic() - self._started
            time.sleep(self.interval_s)

    def at_peak(self) -> str:
        """The peak's processes: "pid (name) N MiB" each, and when it came."""
        def name(pid: int) -> str:
            try:
                with open(f"/proc/{pid}/comm") as f:
                    return f.read().strip()
            except OSError:
                return "gone"
        return (f"at {self.peak_after_s:.2f} s: "
                + ", ".join(f"{p} ({name(p)}) {b / 2**20:.1f} MiB" for p, b in self.peak_parts))
