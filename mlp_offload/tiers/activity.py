"""Whether a file tier's own I/O is moving data now: the signal a background checkpoint writer on the
same device paces behind (``checkpoint.pacing``).

``FileTier`` wraps each operation's data movement (token wait included: a token held elsewhere means
another rank of the node is on the device) in ``moving()``; a background reader's operations are not
counted, so a writer never waits on its own reads. ``quiet()`` is true once nothing has moved for
``quiet_s``: the short gaps between an update's back-to-back operations do not count as idle. An update
marks its whole span busy besides (``window()``): its gaps where it computes are short and many, and a chunk
written into one delays the operation after it; the long quiet spells are the forward and backward.
Where the tier has node-wide tokens, one seen held by another process counts as busy too, and as after an
operation of its own, for ``quiet_s`` after. From a process without the tier's operations (a forked checkpoint
writer), that sighting is all it sees.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from contextlib import contextmanager
from typing import Callable, Optional

QUIET_S = 0.02  # nothing moved for this long: the step's I/O has paused, not merely between two operations
MARK_S = 0.5  # how often the busy time so far is marked, for a busy share over a recent window
MARKS_KEPT = 512  # marks remembered: a window of minutes, a few KB


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
        self._marks = deque([(self._created, 0.0)], maxlen=MARKS_KEPT)  # (time, busy time by then), oldest first

    @contextmanager
    def moving(self, operation: bool = True):
        """An operation moving data (``operation`` False: an update's span, ``window``)."""
        with self._lock:
            if not self.in_flight:
                self._busy_from = self._clock()
            self.in_flight += 1
            self.operations += operation
        try:
            yield
        finally:
            with self._lock:
                self.in_flight -= 1
                self._last_end = self._clock()
                if not self.in_flight:
                    self._busy_s += self._last_end - self._busy_from
                    if self._last_end - self._marks[-1][0] >= MARK_S:
                        self._marks.append((self._last_end, self._busy_s))

    def window(self):
        """An update's whole span: busy throughout, its gaps between operations included."""
        return self.moving(operation=False)

    def busy_share(self, window_s: Optional[float] = None) -> float:
        """Of the time since the tier was made (``window_s``: of about the last ``window_s`` seconds, from the
        busy time marked then, or as far back as the marks reach), the share its own operations moved data."""
        with self._lock:
            now = self._clock()
            busy = self._busy_s + (now - self._busy_from if self.in_flight else 0.0)
            since, busy_then = self._marks[0]
            if window_s is not None:
                for at, busy_at in reversed(self._marks):  # the newest mark at least window_s back
                    if now - at >= window_s:
                        since, busy_then = at, busy_at
                        break
            return (busy - busy_then) / (now - since) if now > since else 0.0

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
