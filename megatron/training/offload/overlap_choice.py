"""Whether --offload-overlap-forward pays on this run: the steps time themselves both ways and keep the faster.

The first steps of an overlapped run settle their update before the next forward (the update in series);
the later ones leave it under the next forward. Beside the forward, the device's update can run slower than
alone and slow the forward more than it hides (docs/benchmarks.md). The time from one
step's start to the next is an iteration: after a settled step it is the serial iteration, after a deferred
one the overlapped iteration. Once both have ``samples`` figures, a slower overlap (the fastest of each,
beyond ``slack``) is turned off: every later step settles.
"""

from __future__ import annotations

from typing import List, Optional


class OverlapChoice:
    def __init__(self, samples: int = 2, slack: float = 0.02, skip: int = 1):
        self.samples, self.slack, self.skip = samples, slack, skip
        self.serial: List[float] = []
        self.overlapped: List[float] = []
        self.overlap_on = True
        self._last_start: Optional[float] = None
        self._last_settled = False
        self._seen = 0

    def step_started(self, now: float) -> Optional[str]:
        """At the start of each step; the line to log where it turns the overlap off, else None."""
        if self._last_start is not None:
            self._seen += 1
            if self._seen > self.skip and self._last_settled is not None:  # (the first iteration also moved
                # state into the gpu tier)
                (self.serial if self._last_settled else self.overlapped).append(now - self._last_start)
        self._last_start = now
        if not self.overlap_on or min(len(self.serial), len(self.overlapped)) < self.samples:
            return None
        serial, overlapped = min(self.serial), min(self.overlapped)
        if overlapped <= serial * (1 + self.slack):
            return None
        self.overlap_on = False
        return (f"--offload-overlap-forward: off from here: overlapped iterations took {overlapped:.3f} s, "
                f"in series {serial:.3f} s (the update beside the forward slowed it more than it hid)")

    def step_ended(self, settled: Optional[bool]) -> None:
        """``settled``: whether the step waited for its update (None: it updated nothing, a skipped step)."""
        self._last_settled = settled
