"""I/O tokens per tier path, so ranks take turns on a shared device.

Node scope (the default): a token is an advisory ``flock`` on a small file in a node-local
directory (``LockDir``). The kernel drops a flock when its holder dies, so a rank killed while
holding a token never blocks the others. Job scope (``JobTokens``): a counter in the job's
key-value store (torch.distributed's), for a path that all nodes share and that should see only
so many ranks of the whole job at once; it needs nothing from the file system, whose locks may
not reach across nodes. Within one process all threads share the process's token (a reference
count), as in the design.
"""

from __future__ import annotations

import fcntl
import hashlib
import os
import tempfile
import threading
import time
from contextlib import contextmanager
from typing import List, Optional

USERS = "users.lock"


def default_lock_root() -> str:
    """Where lock files go when the config names no ``lock_dir``. Node-local on purpose: a lock
    file on a shared file system would serialize whole clusters."""
    return "/dev/shm" if os.path.isdir("/dev/shm") and os.access("/dev/shm", os.W_OK) else tempfile.gettempdir()


def path_key(tier_path: str) -> str:
    return hashlib.sha1(os.path.realpath(tier_path).encode()).hexdigest()[:16]


class LockDir:
    """This node's lock files for one tier path, shared by the processes that use the path.

    Each user holds a shared flock on the directory's USERS file; the last one to leave (the one
    that can turn it into an exclusive lock) removes the directory, USERS file last. A process
    that opened USERS meanwhile finds, once it has its lock, that the file is no longer the one
    at that name, and starts again, so no two processes ever lock different files of one name.
    Per user (uid): another user's directory would not be writable.
    """

    def __init__(self, tier_path: str, lock_root: Optional[str] = None):
        self.base = os.path.join(lock_root or default_lock_root(), f"mlp_offload_locks-{os.getuid()}")
        self.path = os.path.join(self.base, path_key(tier_path))
        self._users: Optional[int] = self._join()

    def _join(self) -> int:
        while True:
            try:
                os.makedirs(self.path, exist_ok=True)
            except (FileNotFoundError, FileExistsError):
                # The last user removed the parent between makedirs' two mkdirs, or removed the
                # directory between makedirs' mkdir (EEXIST) and its isdir check: join again.
                continue
            users = os.path.join(self.path, USERS)
            try:
                fd = os.open(users, os.O_RDWR | os.O_CREAT, 0o600)
            except FileNotFoundError:
                continue  # the last user removed the directory between the two calls
            fcntl.flock(fd, fcntl.LOCK_SH)
            try:
                if os.path.samestat(os.fstat(fd), os.stat(users)):
                    return fd
            except FileNotFoundError:
                pass
            os.close(fd)

    def open(self, name: str) -> int:
        return os.open(os.path.join(self.path, name), os.O_RDWR | os.O_CREAT, 0o600)

    @contextmanager
    def exclusive(self, name: str):
        """Hold ``name``'s lock (blocking): one process of the node at a time."""
        fd = self.open(name)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            yield
        finally:
            os.close(fd)

    def close(self) -> None:
        fd, self._users = self._users, None
        if fd is None:
            return
        try:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                return  # others still use it: the last of them removes it
            for name in os.listdir(self.path):
                if name != USERS:
                    _unlink(os.path.join(self.path, name))
            _unlink(os.path.join(self.path, USERS))
            for directory in (self.path, self.base):
                try:
                    os.rmdir(directory)
                except OSError:
                    pass
        finally:
            os.close(fd)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


class _ProcessTokens:
    """One token per process, shared by its threads; subclasses take and give back the real one."""

    POLL_START_S = 0.0005
    POLL_MAX_S = 0.01

    def __init__(self, count: int):
        if count < 1:
            raise ValueError(f"tokens per tier must be >= 1, got {count}")
        self.count = count
        self._cv = threading.Condition()
        self._holders = 0  # threads of this process currently inside acquire()/release()
        self._acquiring = False
        self._held = None
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
            held = self._take()
        except BaseException:
            with self._cv:
                self._acquiring = False
                self._cv.notify_all()
            raise
        waited = time.perf_counter() - start
        with self._cv:
            self._held = held
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
                self._give(self._held)
                self._held = None

    def __enter__(self):
        self.acquire()
        return self

    def __exit__(self, *exc):
        self.release()

    def _take(self):
        raise NotImplementedError

    def _give(self, held) -> None:
        raise NotImplementedError


class TierTokens(_ProcessTokens):
    """``count`` tokens shared by every process of this node that does I/O on ``tier_path``."""

    def __init__(self, tier_path: str, count: int, lock_root: Optional[str] = None):
        super().__init__(count)
        self._dir = LockDir(tier_path, lock_root)
        self.lock_dir = self._dir.path
        self._fds: List[int] = [self._dir.open(f"token{i}.lock") for i in range(count)]
        # Held shared while an update of this process moves data on the tier (hold_window): a paced writer in
        # another process sees the update's whole span as busy, not only its operations.
        self._window_fd = self._dir.open("window.lock")
        self._windows = 0

    @property
    def lock_files(self) -> int:
        """How many token lock files this process holds open: the tokens the node's ranks contend for."""
        return len(self._fds)

    def _take(self) -> int:
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

    def _give(self, fd: int) -> None:
        fcntl.flock(fd, fcntl.LOCK_UN)

    def hold_window(self) -> None:
        with self._cv:
            if not self._windows:
                fcntl.flock(self._window_fd, fcntl.LOCK_SH)  # shared: the node's ranks update at once
            self._windows += 1

    def release_window(self) -> None:
        with self._cv:
            self._windows -= 1
            if not self._windows:
                fcntl.flock(self._window_fd, fcntl.LOCK_UN)

    def held_elsewhere(self) -> bool:
        """Whether another process of the node holds one of the tokens, or an update's window, now (each tried
        without waiting and given back at once). False while this process holds or takes one: its own I/O says
        busy."""
        with self._cv:
            if self._holders or self._acquiring or self._windows:
                return False
            for fd in self._fds + [self._window_fd]:
                try:
                    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                except BlockingIOError:
                    return True
                fcntl.flock(fd, fcntl.LOCK_UN)
            return False

    def close(self) -> None:
        for fd in self._fds + [self._window_fd]:
            os.close(fd)
        self._fds, self._window_fd = [], None
        self._dir.close()


class JobTokensStalled(RuntimeError):
    """No rank of the job gave a token back for too long (a holder died without releasing)."""


class JobTokens(_ProcessTokens):
    """``count`` tokens shared by every process of the job that does I/O on ``tier_path``.

    ``store`` is a key-value store reachable from every node with an atomic ``add(key, n)`` (a
    ``torch.distributed.Store``). The counter holds the tokens in use; every give-back also bumps
    a release count, so a rank that sees neither change for ``stall_s`` stops with an error
    instead of waiting for a holder that is gone (its job is then failing anyway).
    """

    def __init__(self, tier_path: str, count: int, store, stall_s: float = 600.0):
        super().__init__(count)
        self._store = store
        self._key = f"mlp_offload/tokens/{path_key(tier_path)}"
        self.tier_path = tier_path
        self.stall_s = stall_s

    def _take(self) -> None:
        pause = self.POLL_START_S
        released = self._store.add(self._key + "/released", 0)
        progress = time.monotonic()
        while True:
            if self._store.add(self._key, 1) <= self.count:
                return None
            self._store.add(self._key, -1)
            now_released = self._store.add(self._key + "/released", 0)
            if now_released != released:
                released, progress = now_released, time.monotonic()
            elif time.monotonic() - progress > self.stall_s:
                raise JobTokensStalled(
                    f"{self.tier_path}: no rank of the job released an I/O token of this path for "
                    f"{self.stall_s:.0f} s (a rank holding one died?)")
            time.sleep(pause)
            pause = min(pause * 2, self.POLL_MAX_S * 10)  # every poll is a round trip to the store

    def _give(self, held) -> None:
        self._store.add(self._key, -1)
        self._store.add(self._key + "/released", 1)

    def close(self) -> None:
        pass  # the store goes with the job


def _unlink(path: str) -> None:
    try:
        os.unlink(path)
    except OSError:
        pass
