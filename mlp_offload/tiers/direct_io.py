"""Reading and writing byte ranges of one file at disk speed, with O_DIRECT where the file system has
it (``open_direct``; tmpfs and some network file systems do not: the caller then goes through the page
cache).

Reading (``DirectReads``): the block-aligned span around a range is read by a pool of threads into an
aligned buffer of its own, and the range handed out as a view of it. Through the page cache one thread
read a checkpoint at a fraction of what the disk gives by O_DIRECT with 8 threads (docs/design.md,
"Checkpoint file I/O"). Where there is no O_DIRECT, ``read`` answers None.

Writing (``DirectRegionWriter``): a region is cut into pieces on block boundaries of the file, each piece
copied into one of a ring of aligned staging buffers and written by a pool of threads while the next
pieces are copied; the few bytes at a region's unaligned ends go through the page cache. The CRC32 of
each tensor is chained piece by piece on a thread of its own. A checkpoint file keeps its subgroups back
to back (the format needs no padding), so a region rarely starts or ends on a block. Through the page
cache alone one thread wrote at a fraction of what the disk takes by O_DIRECT with 8 threads, and so did
each rank of an independent save on four GPUs: not the disk's pace (docs/design.md, "Checkpoint file
I/O"). The staging ring is small (8 x 16 MiB): a save must not need host memory the size of a subgroup
beside a full host tier. The file is fsynced by the caller.
"""

from __future__ import annotations

import os
import zlib
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Callable, List, Optional, Sequence

import torch

from ..config.align import ALIGN, align_down, align_up
from .no_fork import aligned_empty
from .to_host import copy_to_host

CHUNK = 8 << 20  # bytes of one read
PIECE = 16 << 20  # bytes of file a staging buffer takes (a multiple of ALIGN)
RING = 8  # staging buffers: up to this many pieces in flight
PACED_RING = 2  # a paced writer's: a tier's operation that starts meanwhile waits behind at most these


def open_direct(path: str, flags: int) -> Optional[int]:
    """A descriptor of ``path`` opened with ``flags`` and O_DIRECT, or None where the platform or the
    file system has no O_DIRECT."""
    if not hasattr(os, "O_DIRECT"):
        return None
    try:
        return os.open(path, flags | os.O_DIRECT)
    except OSError:  # tmpfs and some network file systems
        return None


class DirectReads:
    def __init__(self, path: str, threads: int = 8):
        self.path, self.threads = path, threads
        self.fd: Optional[int] = None
        self.tried = False  # opened at the first read: many readers are made and never read
        self.pool: Optional[ThreadPoolExecutor] = None

    def read(self, offset: int, nbytes: int) -> Optional[memoryview]:
        """File bytes [offset, offset + nbytes), or None where O_DIRECT is not had; short at the end of
        the file where it is shorter."""
        if not self.tried:
            self.tried = True
            self.fd = open_direct(self.path, os.O_RDONLY)
        if self.fd is None:
            return None
        lo, hi = align_down(offset), align_up(offset + nbytes)
        if self.pool is None:
            self.pool = ThreadPoolExecutor(self.threads, thread_name_prefix="ckpt-read")
        # a buffer of its own each time: the caller may keep what it gets (a reader caches two
        # subgroups), and handing out a view of it saves a copy the size of the range
        view = memoryview(aligned_empty(hi - lo).numpy())
        reads = [self.pool.submit(pread_into, self.fd, view[a - lo: min(a + CHUNK, hi) - lo], a)
                 for a in range(lo, hi, CHUNK)]
        got = lo
        for a, r in zip(range(lo, hi, CHUNK), reads):
            n = r.result()
            if got == a:  # contiguous from the start: how far the file reaches
                got = a + n
        end = min(offset + nbytes, got)
        return view[offset - lo: max(offset, end) - lo]

    def close(self) -> None:
        if self.pool is not None:
            self.pool.shutdown(wait=True)
            self.pool = None
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None


def pread_into(fd: int, view, offset: int) -> int:
    """Read into ``view`` from ``offset`` until it is full or the file ends; the bytes read."""
    done = 0
    while done < len(view):
        n = os.preadv(fd, [view[done:]], offset + done)
        if n == 0:
            break
        done += n
    return done


class DirectRegionWriter:
    """``put(offset, tensors)`` writes the tensors' bytes back to back from ``offset`` (the source may
    be reused when it returns) and gives a function that returns their CRC32s once computed;
    ``finish()`` waits for every write."""

    def __init__(self, fd: int, path: str, threads: int = 8, pace: Optional[Callable[[int], None]] = None):
        self.fd = fd
        self.direct = open_direct(path, os.O_WRONLY)  # None where the file system has no O_DIRECT: all through fd
        self.pool = ThreadPoolExecutor(threads, thread_name_prefix="ckpt-write")
        self.crc_thread = ThreadPoolExecutor(1, thread_name_prefix="ckpt-crc")  # in submission order
        self.pace = pace  # called with a piece's bytes before it is written (checkpoint.pacing)
        ring = RING if pace is None else PACED_RING
        self.ring = [aligned_empty(PIECE + ALIGN) for _ in range(ring)]
        self.busy: List[List[Future]] = [[] for _ in range(ring)]  # what still reads each buffer
        self.next = 0

    def put(self, offset: int, tensors: Sequence[torch.Tensor]):
        sources = [t.reshape(-1).view(torch.uint8) for t in tensors]
        bounds, pos = [], offset  # each tensor's file bytes
        for src in sources:
            bounds.append((pos, pos + src.numel()))
            pos += src.numel()
        end, crcs, last = pos, [0] * len(sources), None
        lo = offset
        while lo < end:
            hi = min(align_down(lo) + PIECE, end)  # pieces end on PIECE boundaries of the file
            k, self.next = self.next, (self.next + 1) % len(self.ring)
            _wait(self.busy[k])
            stage, lead = self.ring[k], lo % ALIGN  # stage[b] is file byte align_down(lo) + b
            for j, (a, b) in enumerate(bounds):
                s, e = max(a, lo), min(b, hi)
                if s < e:
                    part = stage[lead + s - lo: lead + e - lo]
                    copy_to_host(part, sources[j][s - a: e - a])  # from the device too
                    last = self.crc_thread.submit(_chain_crc, crcs, j, memoryview(part.numpy()))
                    self.busy[k].append(last)
            if self.pace is not None:
                self.pace(hi - lo)
            self.busy[k] += self._write(stage, lo, hi)
            lo = hi
        return lambda: _after(last, crcs)

    def _write(self, stage: torch.Tensor, lo: int, hi: int) -> List[Future]:
        """File bytes [lo, hi) from ``stage`` (its byte 0 is file byte align_down(lo))."""
        base = align_down(lo)
        inner_lo, inner_hi = align_up(lo), align_down(hi)
        if self.direct is None or inner_lo >= inner_hi:
            inner_lo = inner_hi = hi  # nothing direct: all through the page cache
        view = memoryview(stage.numpy())
        writes = [(self.fd, lo, inner_lo), (self.direct, inner_lo, inner_hi), (self.fd, inner_hi, hi)]
        return [self.pool.submit(pwrite_all, fd, view[a - base: b - base], a) for fd, a, b in writes if a < b]

    def finish(self) -> None:
        for busy in self.busy:
            _wait(busy)

    def close(self) -> None:
        self.pool.shutdown(wait=True)
        self.crc_thread.shutdown(wait=True)
        if self.direct is not None:
            os.close(self.direct)
            self.direct = None


def _after(last: Optional[Future], crcs: List[int]) -> List[int]:
    """``crcs`` once the CRC thread has run ``last`` (it runs its work in order)."""
    if last is not None:
        last.result()
    return crcs


def _chain_crc(crcs: List[int], j: int, data) -> None:
    crcs[j] = zlib.crc32(data, crcs[j])


def _wait(futures: List[Future]) -> None:
    for f in futures:
        f.result()  # an I/O error (a full disk) is raised here, in the writer's thread
    futures.clear()


def pwrite_all(fd: int, data, offset: int) -> None:
    data = memoryview(data)
    while len(data):
        n = os.pwrite(fd, data, offset)
        data, offset = data[n:], offset + n
