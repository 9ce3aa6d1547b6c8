"""A forked writer's files put on the disk as they are written, each piece after its turn on the process's pacer.

``PacedFile`` is what megatron-core's workers open their files with in the forked writer (``paced_flush.install``
gives the opener): the bytes gathered into ``PIECE``-byte pieces of a page-aligned buffer, each written after its
turn on a ``pacing.DiskPacer``, by O_DIRECT where the file system has it, else through the page cache and written
back at once. ``ProcessPacing`` is one process's pacer and counts (made in the process that first asks: the writer
and each worker it forks have their own); each process appends its counts to a report file, which the rank reads
(``read_report``) once the writer is done.
"""

from __future__ import annotations

import errno
import mmap
import os
from dataclasses import dataclass
from typing import Callable, Dict, Optional

from ..config.align import align_down
from ..tiers.direct_io import open_direct, pwrite_all
from .pacing import DiskPacer

PIECE = 32 << 20  # bytes written per turn: a pause in the step's I/O of a few ms is enough for one

SyncRange = Callable[[int, int, int], None]  # (fd, offset, nbytes): that range on the disk, or OSError


@dataclass
class FlushCounts:
    """What one process's paced writes and flushes did (its line of the forked writer's report)."""
    files: int = 0
    pieces: int = 0
    nbytes: int = 0
    unpaced: int = 0  # files whose ranges could not be written back (a plain fsync did it all)


class ProcessPacing:
    """A forked process's pacer and counts, made in the process that first asks (each worker the writer forks
    makes its own, with token files of its own); ``pacer`` None where the lock directory is unusable from
    there (unpaced, durable all the same)."""

    def __init__(self, make_pacer: Callable[[], DiskPacer], sync_range: Optional[SyncRange],
                 report_path: Optional[str] = None):
        self.make_pacer, self.sync_range, self.report_path = make_pacer, sync_range, report_path
        self.pid, self._pacer, self.counts = None, None, FlushCounts()

    @property
    def pacer(self) -> Optional[DiskPacer]:
        if self.pid != os.getpid():
            try:
                self._pacer = self.make_pacer()
            except OSError:
                self._pacer = None
            self.pid, self.counts = os.getpid(), FlushCounts()
        return self._pacer

    def report(self) -> None:
        """This process's counts appended to ``report_path`` (one short line: whole even beside the other
        processes' lines; each process's last line counts)."""
        if self.report_path is None or self._pacer is None:
            return
        c, pacer = self.counts, self._pacer
        line = (f"{os.getpid()} {c.files} {c.pieces} {c.nbytes} {c.unpaced} {pacer.waits} {pacer.waited_s:.3f}\n")
        with open(self.report_path, "a") as f:
            f.write(line)


class PacedFile:
    """A file a forked writer writes (``open(path, "wb")``), put on the disk as it is written: its bytes gathered
    into ``piece``-byte pieces of a page-aligned buffer, each written after its turn on the process's pacer, by
    O_DIRECT where the file system has it (the page cache never holds the file), else through the page cache
    and written back at once (``sync_range``): no dirty pages left for a flush at the fsync, nor for the kernel's
    flusher. ``finish`` (at the file's fsync, or its close) writes the rest; ``expected_bytes``: what the file
    will hold (the pacer plans with it; bytes past it are announced as they come)."""

    OPEN: Dict[int, "PacedFile"] = {}  # descriptor -> the file, for the fsync (os.fsync(f.fileno()))

    def __init__(self, path: str, paced: ProcessPacing, expected_bytes: int = 0, piece: int = PIECE):
        self.paced, self.piece = paced, piece
        self.fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        self.direct = open_direct(path, os.O_WRONLY)
        self._buffer = mmap.mmap(-1, piece)  # page-aligned, as O_DIRECT needs
        self._view = memoryview(self._buffer)
        self.offset, self.filled, self.finished = 0, 0, False  # offset: the file offset of the buffer's first byte
        self.expected = expected_bytes
        pacer = paced.pacer  # first: this process's pacer and counts made where it has none yet
        paced.counts.files += 1
        if pacer is not None and expected_bytes:
            pacer.expect(expected_bytes)
        PacedFile.OPEN[self.fd] = self

    def write(self, data) -> int:
        source = memoryview(data).cast("B")
        n, done = len(source), 0
        while done < n:
            take = min(self.piece - self.filled, n - done)
            self._view[self.filled: self.filled + take] = source[done: done + take]
            self.filled, done = self.filled + take, done + take
            if self.filled == self.piece:
                self._put()
        return n

    def tell(self) -> int:
        return self.offset + self.filled

    def flush(self) -> None:
        """Nothing: the bytes are the disk's once their piece fills, or at ``finish``."""

    def fileno(self) -> int:
        return self.fd

    def finish(self) -> None:
        if not self.finished:
            self.finished = True
            if self.filled:
                self._put()

    def close(self) -> None:
        if self.fd < 0:
            return
        try:
            self.finish()
        finally:
            PacedFile.OPEN.pop(self.fd, None)
            for fd in (self.fd, self.direct):
                if fd is not None:
                    os.close(fd)
            self.fd, self.direct = -1, None
            self._view.release()
            self._buffer.close()

    def __enter__(self) -> "PacedFile":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _put(self) -> None:
        """The buffer's ``filled`` bytes onto the disk at ``offset``, after their turn: the aligned part by
        O_DIRECT, the rest (a file's unaligned end) through the page cache, written back at once."""
        nbytes, paced = self.filled, self.paced
        pacer, counts = paced.pacer, paced.counts
        if pacer is not None:
            beyond = self.offset + nbytes - max(self.expected, self.offset)
            if beyond > 0:  # past what the file was expected to hold: announced as it comes
                pacer.expect(beyond)
                self.expected += beyond
            pacer.wait_turn(nbytes)
        direct = align_down(nbytes) if self.direct is not None else 0
        if direct:
            try:
                pwrite_all(self.direct, self._view[:direct], self.offset)
            except OSError as err:
                if err.errno != errno.EINVAL:
                    raise
                direct = 0  # a file system that takes O_DIRECT opens but not these writes: the page cache
                os.close(self.direct)
                self.direct = None
        if direct < nbytes:
            pwrite_all(self.fd, self._view[direct:nbytes], self.offset + direct)
            self._write_back(self.offset + direct, nbytes - direct)
        counts.pieces += 1
        counts.nbytes += nbytes
        self.offset, self.filled = self.offset + nbytes, 0

    def _write_back(self, offset: int, nbytes: int) -> None:
        if self.paced.sync_range is None:
            return
        try:
            self.paced.sync_range(self.fd, offset, nbytes)
        except OSError:  # refused here (EINVAL, ESPIPE): the fsync writes it back
            self.paced.counts.unpaced += 1
            self.paced.sync_range = None


def read_report(report_path: str) -> str:
    """The forked writer's flushes in one clause (each process's last line counts), the report file removed."""
    try:
        with open(report_path) as report:
            lines = report.read().split("\n")
        os.unlink(report_path)
    except OSError:
        return "its flushes reported nothing"
    last = {}
    for line in lines:
        fields = line.split()
        if len(fields) == 7:
            last[fields[0]] = [float(x) for x in fields[1:]]
    files, pieces, nbytes, unpaced, waits, waited_s = (sum(v[i] for v in last.values()) for i in range(6))
    if not files:
        return "no file flushed paced"
    return (f"{int(files)} files flushed paced ({nbytes / 1e9:.3f} GB in {int(pieces)} pieces, {int(waits)} "
            f"waited {waited_s:.1f} s for the tiers{f', {int(unpaced)} by a plain fsync' if unpaced else ''})")
