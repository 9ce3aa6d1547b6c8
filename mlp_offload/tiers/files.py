"""One file tier: a directory holding subgroup state files, with its own asynchronous I/O pipeline.

Each read or write of a subgroup is one *operation*, run on the tier's small operation pool: it
takes the node-wide token, then splits its byte ranges into blocks that the block pool's threads
move with ``os.pwrite``/``os.preadv`` (these release the GIL, so the threads really run in
parallel). Files are opened with O_DIRECT where the file system allows it, from ALIGN-aligned
host buffers. Each block carries a CRC32, checked when it is read back.
"""

from __future__ import annotations

import errno
import logging
import os
import time
import zlib
from concurrent.futures import Future, ThreadPoolExecutor, wait
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass
from typing import Callable, Dict, List, Optional, Sequence, Set, Tuple

import torch

from ..config.align import ALIGN
from .activity import TierActivity
from .housekeeping import claim, release
from .tokens import TierTokens
from ..config.units import GiB

log = logging.getLogger("mlp_offload")

# One contiguous piece of a transfer: (offset in the file, aligned uint8 host tensor).
Extent = Tuple[int, torch.Tensor]


class TierPathError(RuntimeError):
    """A tier directory is missing, not a directory, or not writable."""


class TierIOError(RuntimeError):
    """A read or write on a tier failed (disk full, path gone, read-only, ...)."""


class TierDataError(RuntimeError):
    """Data read back from a tier is truncated or does not match its checksum."""


@dataclass
class OpResult:
    nbytes: int
    busy_s: float  # time moving data, token wait excluded
    token_wait_s: float
    start: float = 0.0  # perf_counter when data began to move (for the optional trace)


def check_tier_dir(name: str, path: str) -> str:
    """Resolve and validate a tier directory; errors name the flag that set it."""
    flag = f"paths[{name!r}]"
    if not os.path.exists(path):
        raise TierPathError(f"{flag} {path}: the directory does not exist")
    if not os.path.isdir(path):
        raise TierPathError(f"{flag} {path}: not a directory")
    if not os.access(path, os.W_OK | os.X_OK):
        raise TierPathError(f"{flag} {path}: not writable by this process (uid {os.getuid()})")
    return os.path.realpath(path)


@dataclass(frozen=True)
class TierOwner:
    """Whose files a tier holds: the run and the rank (``<root>/mlp_offload/<run_id>/rank<r>/``);
    ``reports_stale``: whether this rank lists other runs' stale namespaces (the node's first)."""
    run_id: str
    rank: int
    reports_stale: bool = True


@dataclass(frozen=True)
class FileIo:
    """How a tier moves its files: blocks of ``block_bytes`` on ``io_threads`` threads, whole
    operations on ``op_threads``; O_DIRECT where the file system has it; block checksums checked."""
    block_bytes: int
    io_threads: int
    op_threads: int
    use_odirect: bool = True
    verify_checksums: bool = True


class FileTier:
    """Subgroup files of one rank under ``<root>/mlp_offload/<run_id>/rank<r>/`` (a
    ``tiers.base.StreamedTier``). ``tokens`` are the node-wide turns on this path; None only for
    the bandwidth probe, which holds the path's probe lock (under ``lock_root``) instead."""

    kind = "streamed"

    def __init__(self, name: str, root: str, owner: TierOwner, io: FileIo, tokens: Optional[TierTokens] = None,
                 lock_root: Optional[str] = None):
        self.name = name
        self.root = check_tier_dir(name, root)
        try:
            self.dir = claim(self.root, owner.run_id, owner.rank, field=f"paths[{name!r}]",
                             reports_stale=owner.reports_stale)
        except OSError as err:
            raise TierPathError(f"paths[{name!r}] {root}: cannot create this rank's directory: {err}") from err
        self.device = os.stat(self.root).st_dev  # tiers on one device share its bandwidth
        self.block_bytes = io.block_bytes
        self.io_threads = io.io_threads
        self.verify_checksums = io.verify_checksums
        self.tokens = tokens
        # Its own operations moving data: what a background writer on this device waits out (checkpoint.pacing).
        self.activity = TierActivity(elsewhere=tokens.held_elsewhere if isinstance(tokens, TierTokens) else None)
        self.lock_root = lock_root  # the node-local lock files' directory (None: tokens.default_lock_root)
        self.odirect = io.use_odirect and self._odirect_supported()
        if io.use_odirect and not self.odirect:
            log.warning(
                "tier %s (%s): the file system does not support O_DIRECT (tmpfs?); "
                "using buffered I/O, so bandwidths include the page cache",
                name,
                self.root,
            )
        self._blocks = ThreadPoolExecutor(io.io_threads, thread_name_prefix=f"mlp-io-{name}")
        self._ops = ThreadPoolExecutor(io.op_threads, thread_name_prefix=f"mlp-op-{name}")
        self._op_threads = io.op_threads
        self._crcs: Dict[str, List[int]] = {}
        self._sizes: Dict[str, int] = {}
        # Keys whose file has a second name (a checkpoint snapshot's link): their next write goes to
        # a new file, so the linked one keeps the bytes it had.
        self._linked: Set[str] = set()
        self.closed = False

    # -- public API ------------------------------------------------------------------------
    def path_of(self, key: str) -> str:
        return os.path.join(self.dir, key)

    def submit_write(self, key: str, extents: Sequence[Extent], before: Optional[Callable] = None,
                     after: Optional[Callable[[OpResult], None]] = None) -> Future:
        """Write ``extents`` to file ``key``; ``before`` runs first in the operation's thread,
        ``after`` gets the result of a successful write before the future completes."""
        return self._ops.submit(self._run_op, "write", key, list(extents), before, after)

    def submit_read(self, key: str, extents: Sequence[Extent], before: Optional[Callable] = None,
                    after: Optional[Callable[[OpResult], None]] = None, background: bool = False,
                    first_block: int = 0) -> Future:
        """Read file ``key`` into ``extents``; ``before`` runs first (e.g. wait for the buffer),
        ``after`` as for writes. ``background``: a checkpoint writer's read, not counted in ``activity``.
        ``first_block``: the extents are a part of the file's, from its block of that number (a piece of a
        read split up: their CRCs are checked against those blocks')."""
        return self._ops.submit(self._run_op, "background read" if background else "read", key, list(extents),
                                before, after, first_block)

    def submit(self, fn: Callable, *args) -> Future:
        """Run ``fn`` on the operation pool (for work ordered with this tier's I/O)."""
        return self._ops.submit(fn, *args)

    @contextmanager
    def widened(self, factor: int):
        """Run with ``factor`` times the threads, as ``factor`` ranks of one node would (probing)."""
        narrow = self._blocks, self._ops
        self._blocks = ThreadPoolExecutor(self.io_threads * factor, thread_name_prefix=f"mlp-io-{self.name}")
        self._ops = ThreadPoolExecutor(self._op_threads * factor, thread_name_prefix=f"mlp-op-{self.name}")
        try:
            yield self
        finally:
            self._ops.shutdown(wait=True)
            self._blocks.shutdown(wait=True)
            self._blocks, self._ops = narrow

    def free_bytes(self) -> int:
        st = os.statvfs(self.root)
        return st.f_bavail * st.f_frsize

    def link(self, key: str, alias: str) -> None:
        """Give file ``key`` the second name ``alias`` (a hard link: no data moves), readable as a
        key of its own with the checksums ``key`` has now; ``key`` stays writable, its next write
        going to a new file. No write of ``key`` may be in flight."""
        alias_path = self.path_of(alias)
        os.makedirs(os.path.dirname(alias_path), exist_ok=True)
        os.link(self.path_of(key), alias_path)
        self._crcs[alias] = list(self._crcs[key])
        self._sizes[alias] = self._sizes[key]
        self._linked.add(key)

    def link_out(self, key: str, dest: str) -> None:
        """Give file ``key`` the name ``dest`` outside the tier (a checkpoint's part file): its bytes
        stay as they are, ``key``'s next write going to a new file. No write of ``key`` may be in flight."""
        os.link(self.path_of(key), dest)
        self._linked.add(key)

    def link_in(self, key: str, source: str, crcs: List[int], size: int) -> None:
        """Make file ``source`` (a checkpoint's part on this file system) file ``key`` by hard link,
        replacing any file of that key, as if written here with block CRCs ``crcs`` and ``size``
        bytes (reads check them); ``key``'s next write goes to a new file, so ``source`` keeps its
        bytes. Raises the OSError of a refused link, leaving ``key`` as it was."""
        path = self.path_of(key)
        staged = path + ".link"  # renamed over ``key``: a crash leaves the old file or the new one
        try:
            os.unlink(staged)
        except FileNotFoundError:
            pass
        os.link(source, staged)
        os.replace(staged, path)
        self._crcs[key] = list(crcs)
        self._sizes[key] = size
        self._linked.add(key)

    def block_crcs(self, key: str) -> List[int]:
        """The CRC32 of each block of file ``key`` as last written (its regions' blocks, in order)."""
        return list(self._crcs[key])

    def forget(self, key: str) -> None:
        """Delete file ``key`` and what this tier knows of it."""
        self._sizes.pop(key, None)
        self._crcs.pop(key, None)
        self._linked.discard(key)
        try:
            os.unlink(self.path_of(key))
        except FileNotFoundError:
            pass

    def close(self, remove_files: bool = True) -> None:
        if self.closed:
            return
        self.closed = True
        self._ops.shutdown(wait=True)
        self._blocks.shutdown(wait=True)
        if self.tokens is not None:
            self.tokens.close()
        if remove_files:
            release(self.dir)

    @contextmanager
    def step_window(self):
        """Around an update: the tier busy to a paced background writer for its whole span, in this process
        (``activity``) and in the node's others (the tokens' window lock)."""
        shared = isinstance(self.tokens, TierTokens)
        if shared:
            self.tokens.hold_window()
        try:
            with self.activity.window():
                yield
        finally:
            if shared:
                self.tokens.release_window()

    # -- operations ------------------------------------------------------------------------
    def _run_op(self, kind: str, key: str, extents: List[Extent], before: Optional[Callable],
                after: Optional[Callable[[OpResult], None]], first_block: int = 0) -> OpResult:
        if before is not None:
            before()
        with self.activity.moving() if kind != "background read" else nullcontext():
            token_wait = self.tokens.acquire() if self.tokens else 0.0
            try:
                start = time.perf_counter()
                if kind == "write":
                    nbytes = self._write(key, extents)
                else:
                    nbytes = self._read(key, extents, first_block)
                result = OpResult(nbytes, time.perf_counter() - start, token_wait, start)
            finally:
                if self.tokens:
                    self.tokens.release()
        if after is not None:
            after(result)
        return result

    def _blocks_of(self, extents: List[Extent]):
        for file_off, buf in extents:
            n = buf.numel()
            mv = memoryview(buf.numpy())
            for pos in range(0, n, self.block_bytes):
                yield file_off + pos, mv[pos : min(pos + self.block_bytes, n)]

    def _open(self, path: str, flags: int) -> int:
        if self.odirect:
            flags |= os.O_DIRECT
        return os.open(path, flags, 0o600)

    def _write(self, key: str, extents: List[Extent]) -> int:
        path = self.path_of(key)
        if key in self._linked:  # a snapshot reads the old file by its other name: leave it as it is
            self._linked.discard(key)
            try:
                os.unlink(path)
            except OSError as err:
                raise self.io_error("unlink", path, err) from err
        try:
            fd = self._open(path, os.O_WRONLY | os.O_CREAT)
        except OSError as err:
            raise self.io_error("open for writing", path, err) from err
        try:
            blocks = list(self._blocks_of(extents))
            futures = [self._blocks.submit(_pwrite_block, fd, off, mv, self.verify_checksums) for off, mv in blocks]
            crcs = self._collect(futures, "write", path)
        finally:
            os.close(fd)
        self._crcs[key] = crcs
        self._sizes[key] = sum(len(mv) for _, mv in blocks)
        return self._sizes[key]

    def _read(self, key: str, extents: List[Extent], first_block: int = 0) -> int:
        path = self.path_of(key)
        if key not in self._sizes:
            raise TierDataError(f"tier {self.name}: {path} was never written by this run")
        try:
            fd = self._open(path, os.O_RDONLY)
        except OSError as err:
            raise self.io_error("open for reading", path, err) from err
        try:
            blocks = list(self._blocks_of(extents))
            futures = [self._blocks.submit(_pread_block, fd, off, mv, self.verify_checksums) for off, mv in blocks]
            crcs = self._collect(futures, "read", path)
        finally:
            os.close(fd)
        if self.verify_checksums:
            expected = self._crcs[key][first_block:]
            for i, (got, want) in enumerate(zip(crcs, expected)):
                if got != want:
                    off = blocks[i][0]
                    raise TierDataError(
                        f"tier {self.name}: {path} is corrupt: checksum mismatch in the block at "
                        f"byte {off} ({len(blocks[i][1])} bytes); the data was not used"
                    )
        return sum(len(mv) for _, mv in blocks)

    def _collect(self, futures: List[Future], what: str, path: str) -> List[int]:
        wait(futures)
        results = []
        for f in futures:
            err = f.exception()
            if err is None:
                results.append(f.result())
            elif isinstance(err, TierDataError):
                raise TierDataError(f"tier {self.name}: {path}: {err}") from err
            elif isinstance(err, OSError):
                raise self.io_error(what, path, err) from err
            else:
                raise err
        return results

    def io_error(self, what: str, path: str, err: OSError) -> TierIOError:
        """The error a failed ``what`` on ``path`` raises: the tier, the file and the likely cause."""
        hint = {
            errno.ENOSPC: f"the file system is full ({self.free_bytes() / GiB:.2f} GiB free); "
            f"free space, use another paths[{self.name!r}], or raise host_budget_bytes",
            errno.EDQUOT: "the disk quota is exhausted; free space or use another path",
            errno.EROFS: f"the file system is read-only; use a writable paths[{self.name!r}]",
            errno.EACCES: f"permission denied; use a writable paths[{self.name!r}]",
            errno.ENOENT: "the tier directory disappeared during the run",
        }.get(err.errno, "")
        return TierIOError(f"tier {self.name}: {what} {path} failed: {err.strerror or err}" + (f" ({hint})" if hint else ""))

    # -- setup helpers -----------------------------------------------------------------------
    def _odirect_supported(self) -> bool:
        probe = os.path.join(self.dir, ".odirect_probe")
        buf = torch.zeros(2 * ALIGN, dtype=torch.uint8)
        shift = (-buf.data_ptr()) % ALIGN
        try:
            fd = os.open(probe, os.O_WRONLY | os.O_CREAT | os.O_DIRECT, 0o600)
        except OSError:
            return False
        try:
            os.pwrite(fd, memoryview(buf[shift : shift + ALIGN].numpy()), 0)
            return True
        except OSError:
            return False
        finally:
            os.close(fd)
            os.unlink(probe)


def _pwrite_block(fd: int, off: int, mv: memoryview, checksum: bool) -> int:
    done = 0
    while done < len(mv):
        done += os.pwrite(fd, mv[done:], off + done)
    return zlib.crc32(mv) if checksum else 0


def _pread_block(fd: int, off: int, mv: memoryview, checksum: bool) -> int:
    done = 0
    while done < len(mv):
        n = os.preadv(fd, [mv[done:]], off + done)
        if n == 0:
            raise TierDataError(
                f"truncated: expected {len(mv)} bytes at offset {off}, the file ends after {done}"
            )
        done += n
    return zlib.crc32(mv) if checksum else 0


def fsync_path(path: str) -> None:
    """fsync a file or a directory by name (a directory, to make a rename in it durable)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)

