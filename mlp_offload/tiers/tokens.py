"""Node-wide I/O tokens per tier path, so ranks of one node take turns on a shared device.

A token is an advisory ``flock`` on a small file in a node-local directory. The kernel drops a
flock when its holder dies, so a rank killed while holding a token never blocks the others.
Within one process all threads share the process's token (a reference count), as in the design.
"""

from __future__ import annotations

import fcntl
import hashlib
import os
import tempfile
import threading
import time
from typing import List, Optional


def default_lock_root() -> str:
    # Node-local on purpose: a lock file on a shared file system would serialize whole clusters.
    base = os.environ.get("MLP_OFFLOAD_LOCK_DIR")
    if base:
        return base
    return "/dev/shm" if os.path.isdir("/dev/shm") and os.access("/dev/shm", os.W_OK) else tempfile.gettempdir()


class TierTokens:
    """``count`` tokens shared by every process of this node that does I/O on ``tier_path``."""

    POLL_START_S = 0.0005
    POLL_MAX_S = 0.01

    def __init__(self, tier_path: str, count: int, lock_root: Optional[str] = None):
        if count < 1:
            raise ValueError(f"tokens per tier must be >= 1, got {count}")
        key = hashlib.sha1(os.path.realpath(tier_path).encode()).hexdigest()[:16]
        self.lock_dir = os.path.join(lock_root or default_lock_root(), "mlp_offload_tokens", key)
        os.makedirs(self.lock_dir, exist_ok=True)
        self._fds: List[int] = [
            os.open(os.path.join(self.lock_dir, f"token{i}.lock"), os.O_RDWR | os.O_CREAT, 0o666)
            for i in range(count)
        ]
        self._cv = threading.Condition()
        self._holders = 0  # threads of this process currently inside acquire()/release()
        self._acquiring = False
        self._held_fd: Optional[int] = None
        self.wait_s = 0.0  # total time this process waited for another process's token

    def acquire(self) -> float:
        """Take the process's token (blocking); returns seconds waited."""
        with self._cv:
            while self._acquiring:
                self._cv.wait()
            if self._holders > 0:
                self._holders += 1
                return 0.0
            self._acquiring = True
        start = time.perf_counter()
        try:
            fd = self._take_any()
        except BaseException:
            with self._cv:
                self._acquiring = False
                self._cv.notify_all()
            raise
        waited = time.perf_counter() - start
        with self._cv:
            self._held_fd = fd
            self._holders = 1
            self._acquiring = False
            self.wait_s += waited
            self._cv.notify_all()
        return waited

    def release(self) -> None:
        with self._cv:
            if self._holders <= 0:
                raise RuntimeError("I/O token released more often than acquired")
            self._holders -= 1
            if self._holders == 0:
                fcntl.flock(self._held_fd, fcntl.LOCK_UN)
                self._held_fd = None

    def __enter__(self):
        self.acquire()
        return self

    def __exit__(self, *exc):
        self.release()

    def _take_any(self) -> int:
        # Non-blocking tries over all tokens with a short back-off: a blocking flock on one file
        # would miss another token that frees up first.
        pause = self.POLL_START_S
        offset = os.getpid() % len(self._fds)
        while True:
            for i in range(len(self._fds)):
                fd = self._fds[(offset + i) % len(self._fds)]
                try:
                    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                    return fd
                except BlockingIOError:
                    continue
            time.sleep(pause)
            pause = min(pause * 2, self.POLL_MAX_S)

    def close(self) -> None:
        for fd in self._fds:
            os.close(fd)
        self._fds = []
