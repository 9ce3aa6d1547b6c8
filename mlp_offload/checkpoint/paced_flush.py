"""A forked writer's files put on the disk paced behind the file tiers, like the offloaded state's writer.

With --async-save, megatron-core's torch_dist writer is a process forked per save, which forks one worker per
file; each worker writes its file (``open(path, "wb")``) and ends it with ``os.fsync``. Left as is, the file fills
the page cache at memory speed and the fsync sends it to the disk at once, at the disk's full rate: a file tier's
step I/O on that disk queues behind it (the idle I/O class does not prevent it: see
megatron/training/runtime/io_priority.py), and the rank's steps share the node's memory with gigabytes of dirty
pages. ``install`` (called in that forked process only, before it forks its workers, which inherit it) replaces
``os.fsync`` there with ``paced_fsync`` and gives the opener of ``paced_file.PacedFile``s, which the Megatron side
makes megatron-core's workers open their files with: each file goes to the disk as it is written, in ``PIECE`` pieces,
each after its turn on a ``pacing.DiskPacer`` (at once while the tiers are quiet, else at the cap), by O_DIRECT
where the file system has it, else through the page cache and written back at once (Linux ``sync_file_range``);
the fsync then writes the file's last piece and makes it durable as before.

A file not opened through ``PacedFile`` (a writer that opens its files otherwise) is written back at its fsync
instead: in pieces by ``sync_file_range``, each after its turn, then one real ``fsync``. Such a flush must end
before the kernel's flusher threads take the pages (an age of tens of seconds, a share of host memory), which would
write the rest unpaced, all at once beside a step: pacing lost, never durability. So the forked writer's bytes are
due by ``EXPIRE_SHARE`` of that age from the save where that comes before the next save
(``/proc/sys/vm/dirty_expire_centisecs``).

Flushes first: torch_dist's files are due before the offloaded state's writer (the kernel's dirty age), and where
both take the tiers' quiet spells each gets half of them, so the forked writer's pacer, seeing its rate halved, puts
bytes beside the steps' I/O. So the rank holds a shared lock on ``RUNNING`` (in the first tier's lock directory) across
the fork of the writer (``FlushPacing.held_across_fork``): the forked writer inherits it, the rank closes its copy,
and the lock is held exactly as long as the writer and the workers it forks live. The offloaded state's writer waits
while ``FlushPacing.writer_running`` sees it (``pacing.DiskPacer.yield_to_first``).

Seeing the tiers from another process: a tier's operations hold the node's tokens (``tiers.tokens``: flocks
on files in a lock directory that every process of the node shares), so ``SeenTier`` probes them through
files it opens itself (a flock inherited through the fork is the rank's own, and would always be granted).
Tiers whose tokens are job-wide (a key-value store) cannot be seen from here: no pacing behind them.
"""

from __future__ import annotations

import ctypes
import fcntl
import os
import stat
import sys
import time
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Callable, Iterator, List, Optional, Sequence, Tuple

from ..tiers.activity import TierActivity
from ..tiers.tokens import TierTokens
from .paced_file import PIECE, FlushCounts, PacedFile, ProcessPacing, SyncRange
from .pacing import (AHEAD, CALIBRATE_SHARE, DiskPacer, due_at, rank_disk_bps, recent_busy_share, same_device_tiers,
                     writer_cap)

EXPIRE_SHARE = 0.8  # of the kernel's dirty age: when the flushes are due at the latest (its flusher's age, less slack)
DIRTY_EXPIRE = "/proc/sys/vm/dirty_expire_centisecs"
RUNNING = "forked_writer.lock"  # held shared for a forked writer's life: its flushes are due first
SYNC_FILE_RANGE_WAIT_BEFORE, SYNC_FILE_RANGE_WRITE, SYNC_FILE_RANGE_WAIT_AFTER = 1, 2, 4
WRITE_AND_WAIT = SYNC_FILE_RANGE_WAIT_BEFORE | SYNC_FILE_RANGE_WRITE | SYNC_FILE_RANGE_WAIT_AFTER


def sync_file_range() -> Optional[SyncRange]:
    """libc's ``sync_file_range`` (write back a byte range and wait for it), None where there is none."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        function = ctypes.CDLL(None, use_errno=True).sync_file_range
    except (OSError, AttributeError):
        return None
    function.argtypes = [ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_uint]
    function.restype = ctypes.c_int

    def sync_range(fd: int, offset: int, nbytes: int) -> None:
        if function(fd, offset, nbytes, WRITE_AND_WAIT) != 0:
            err = ctypes.get_errno()
            raise OSError(err, os.strerror(err))

    return sync_range


def paced_flush(fd: int, pacer: DiskPacer, sync_range: SyncRange, fsync: Callable[[int], None],
                counts: FlushCounts, piece: int = PIECE) -> None:
    """``fd``'s file written back piece by piece, in order, each after its turn on ``pacer``, then fsynced."""
    size = os.fstat(fd).st_size
    counts.files += 1
    pacer.expect(size)
    try:
        for offset in range(0, size, piece):
            nbytes = min(piece, size - offset)
            pacer.wait_turn(nbytes)
            sync_range(fd, offset, nbytes)
            counts.pieces += 1
            counts.nbytes += nbytes
    except OSError:  # a file system that refuses it (EINVAL, ESPIPE): the fsync below does the rest
        counts.unpaced += 1
    fsync(fd)  # the metadata, and what a range write left (pages dirtied again): durable as a plain fsync


class SeenTier:
    """A tier as a ``DiskPacer`` asks about it (its ``activity``), seen from another process: busy as its
    node-wide tokens show (``TierActivity`` with no operations of its own)."""

    def __init__(self, tokens: TierTokens, clock: Callable[[], float] = time.monotonic):
        self.activity = TierActivity(clock, elsewhere=tokens.held_elsewhere)


@dataclass(frozen=True)
class FlushPacing:
    """What a forked writer needs to pace its flushes: the tiers' token files and the cap. Made in the rank,
    used in the forked processes (each opens its own token files)."""
    tier_names: Tuple[str, ...]
    tier_tokens: Tuple[Tuple[str, int], ...]  # (tier directory, tokens): where TierTokens finds its lock files
    lock_root: Optional[str]
    cap_bps: float  # of each writer process
    report_path: Optional[str] = None  # each process appends its FlushCounts here
    due_at: Optional[float] = None  # time.monotonic() (the machine's, in every process) to be done by
    due_why: str = "before the next save"
    busy_share: float = 1.0  # the tiers' recent busy share, as the rank saw it (a raise spreads over their busy time)
    running_path: Optional[str] = None  # RUNNING's file: held while the forked writer lives

    def pacer(self, clock: Callable[[], float] = time.monotonic, sleep: Callable[[float], None] = time.sleep):
        tiers = [SeenTier(TierTokens(root, count, self.lock_root), clock)
                 for root, count in self.tier_tokens]
        return DiskPacer(tiers, self.cap_bps, clock=clock, sleep=sleep, due_at=self.due_at, busy_share=self.busy_share)

    def running_lock(self) -> Optional[int]:
        """A descriptor holding a shared lock on ``running_path`` (None without one): the writer that holds a copy
        of it, and the workers it forks, are ``writer_running`` until every copy is closed."""
        if self.running_path is None:
            return None
        fd = os.open(self.running_path, os.O_RDWR | os.O_CREAT, 0o600)
        fcntl.flock(fd, fcntl.LOCK_SH)
        return fd

    @contextmanager
    def held_across_fork(self) -> Iterator[None]:
        """Around the fork of the writer: ``running_lock`` taken before it, so the writer and the workers it forks
        inherit it, and this process's copy closed after, so the lock lives as long as they do."""
        fd = self.running_lock()
        try:
            yield
        finally:
            if fd is not None:
                os.close(fd)  # the forked writer's copy keeps the lock

    def writer_running(self) -> bool:
        """Whether the forked writer (``held_across_fork``) still lives: its lock tried without waiting."""
        if self.running_path is None:
            return False
        try:
            fd = os.open(self.running_path, os.O_RDWR | os.O_CREAT, 0o600)
        except OSError:
            return False  # the lock directory gone: its users have left
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return True
        finally:
            os.close(fd)  # gives back a lock it got
        return False

    def describe(self) -> str:
        due = ("" if self.due_at is None else
               f", to be done in {max(0.0, self.due_at - time.monotonic()):.1f} s, {self.due_why} (the quiet "
               f"spells taken as they come; beside the tiers' I/O, after the first {100 * CALIBRATE_SHARE:.0f}% of "
               f"that time, what they leave, spread evenly over the first {100 / AHEAD:.0f}% of it)")
        return (f"its files put on the disk as written, in {PIECE >> 20} MiB pieces paced behind the "
                f"{'/'.join(self.tier_names)} tier "
                f"(<= {self.cap_bps / 1e9:.2f} GB/s per writer process beside its I/O{due})")


def flush_pacing(engines: Sequence, path: str, writer_processes: int,
                 next_save_in_s: Optional[float] = None) -> Optional[FlushPacing]:
    """The pacing of a forked writer's flushes into ``path`` (a checkpoint's directory), None where no file
    tier with node-wide tokens shares its device or ``sync_file_range`` is missing (plain fsyncs then);
    ``next_save_in_s``: when the next save comes, which the flushes are to be done before (None: unknown).
    Its ``report_path`` is the caller's to set."""
    if sync_file_range() is None:
        return None
    tiers, seen = [], set()
    for engine in engines:
        for tier in same_device_tiers(engine, path):
            if isinstance(tier.tokens, TierTokens) and tier.root not in seen:
                seen.add(tier.root)
                tiers.append((engine, tier))
    if not tiers:
        return None
    cap_bps = writer_cap(rank_disk_bps(tiers)) / max(1, writer_processes)  # the offload writer's share beside it
    due, why = due_at(next_save_in_s), "before the next save"
    expire_s = dirty_expire_s()
    if expire_s is not None and (due is None or time.monotonic() + EXPIRE_SHARE * expire_s < due):
        due = time.monotonic() + EXPIRE_SHARE * expire_s
        why = f"before the kernel's flusher takes pages dirty for {expire_s:.0f} s"
    return FlushPacing(tuple(dict.fromkeys(tier.name for _, tier in tiers)),
                       tuple((tier.root, tier.tokens.lock_files) for _, tier in tiers),
                       tiers[0][1].lock_root, cap_bps, due_at=due, due_why=why,
                       busy_share=recent_busy_share([tier for _, tier in tiers], next_save_in_s),
                       running_path=os.path.join(tiers[0][1].tokens.lock_dir, RUNNING))


def dirty_expire_s() -> Optional[float]:
    """The age at which the kernel's flusher threads write dirty pages back themselves, None where unknown or off."""
    try:
        with open(DIRTY_EXPIRE) as f:
            centiseconds = int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return None
    return centiseconds / 100 if centiseconds > 0 else None


_REAL_FSYNC: List = []  # [os.fsync as it was] in a process where install ran (a forked writer)


def install(pacing: FlushPacing, sync_range: Optional[SyncRange] = None) -> Optional[Callable[..., PacedFile]]:
    """In this process (a forked writer: never the rank), and the workers it forks: ``os.fsync`` replaced by
    ``paced_fsync``. Returns the opener of ``PacedFile``s, ``paced_open(path, expected_bytes)``, that its files are
    to be written through (None where nothing was installed: no ``sync_file_range``, or installed already)."""
    sync_range = sync_range or sync_file_range()
    if sync_range is None or _REAL_FSYNC:
        return None
    real_fsync = os.fsync
    paced = ProcessPacing(pacing.pacer, sync_range, pacing.report_path)

    def paced_fsync(fd) -> None:
        fd = fd if isinstance(fd, int) else fd.fileno()
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            return real_fsync(fd)
        written = PacedFile.OPEN.get(fd)
        if written is not None:  # on the disk as it was written: its end, then the metadata
            written.finish()
            real_fsync(fd)
        elif paced.pacer is None:
            return real_fsync(fd)
        else:
            paced_flush(fd, paced.pacer, sync_range, real_fsync, paced.counts)
        paced.report()

    def paced_open(path: str, expected_bytes: int = 0) -> PacedFile:
        return PacedFile(path, paced, expected_bytes)

    _REAL_FSYNC.append(real_fsync)
    os.fsync = paced_fsync
    return paced_open


def uninstall() -> None:
    """``os.fsync`` back as it was (a process that runs one write after another; tests)."""
    if _REAL_FSYNC:
        os.fsync = _REAL_FSYNC.pop()
