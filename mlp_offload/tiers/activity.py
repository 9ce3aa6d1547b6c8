"""Whether a file tier's own I/O is moving data now: the signal a background checkpoint writer on the
same device paces behind (``checkpoint.pacing``).

``FileTier`` wraps each operation's data movement (token wait included: a token held elsewhere means
another rank of the node is on the device) in ``moving()``; a background reader's operations are not
counted, so a writer never waits on its own reads. ``quiet()`` is true once nothing has moved for
``quiet_s``: the short gaps between an update's back-to-back operations do not count as idle.
Where the tier has node-wide tokens, one seen held by another process counts as busy too, and as after an
operation of its own, for ``quiet_s`` after. From a process without the tier's operations (a forked checkpoint
writer), that sighting is all it sees.
"""

from __future__ import annotations

import bisect
import threading
import time
from collections import deque
from contextlib import contextmanager
from typing import Callable, Optional

QUIET_S = 0.02  # nothing moved for this long: the step's I/O has paused, not merely between two operations
SPELLS_KEPT = 4096  # busy spells remembered for a recent busy share: many steps' worth, a few hundred KB


class TierActivity:
    def __init__(self, clock: Callable[[], float] = time.monotonic, elsewhere: Optional[Callable[[], bool]] = None):
        self._clock = clock
        self._elsewhere = elsewhere  # another process of the node holds one of the path's tokens
        self._lock = threading.Lock()
        self.in_flight = 0
        self.operations = 0  # counted operations since start (tests and the writer's report)
        self._last_end = float("-inf")
        self._seen_elsewhere = float("-inf")  # the last time another process was seen holding a token
        self._created = clock()
        self._busy_from = 0.0
        self._busy_s = 0.0  # time with at least one operation moving data
        self._spell_ends = deque(maxlen=SPELLS_KEPT)  # (when a busy spell ended, _busy_s then), oldest first

    @contextmanager
    def moving(self):
        with self._lock:
            if not self.in_flight:
                self._busy_from = self._clock()
            self.in_flight += 1
            self.operations += 1
        try:
            yield
        finally:
            with self._lock:
                self.in_flight -= 1
                self._last_end = self._clock()
                if not self.in_flight:
                    self._busy_s += self._last_end - self._busy_from
                    self._spell_ends.append((self._last_end, self._busy_s))

    def busy_share(self, window_s: Optional[float] = None) -> float:
        """Of the time since the tier was made (``window_s``: of the last ``window_s`` seconds, or as far back
        as the busy spells remembered reach), the share its own operations moved data."""
        with self._lock:
            now = self._clock()
            busy = self._busy_at(now)
            since = self._created if window_s is None else max(self._created, now - window_s)
            busy_then = self._busy_at(since)
            if busy_then is None:  # spells forgotten: from the oldest one remembered
                since, busy_then = self._spell_ends[0]
            return (busy - busy_then) / (now - since) if now > since else 0.0

    def _busy_at(self, t: float) -> Optional[float]:
        """The busy time from the tier's making up to ``t`` (None: before the spells remembered). Lock held."""
        k = bisect.bisect_right(self._spell_ends, (t, float("inf")))  # spells ended by t: the first k
        if k == 0 and len(self._spell_ends) == self._spell_ends.maxlen and t > self._created:
            return None
        busy = self._spell_ends[k - 1][1] if k else 0.0
        if k < len(self._spell_ends):  # the next spell may have begun by t
            end, busy_at_end = self._spell_ends[k]
            started = end - (busy_at_end - busy)
        else:
            started = self._busy_from if self.in_flight else float("inf")
        return busy + max(0.0, t - started)

    def quiet(self, quiet_s: float = QUIET_S) -> bool:
        with self._lock:
            if self.in_flight or self._clock() - self._last_end < quiet_s:
                return False
        if self._elsewhere is not None and self._elsewhere():
            with self._lock:
                self._seen_elsewhere = self._clock()  # busy for quiet_s after, as after an operation of its own
            return False
        with self._lock:
            return self._clock() - self._seen_elsewhere >= quiet_s
