"""Reading and writing byte ranges of one file at disk speed, with O_DIRECT where the file system has
it (``open_direct``; tmpfs and some network file systems do not: the caller then goes through the page
cache).

Reading (``DirectReads``): the block-aligned span around a range is read by a pool of threads into an
aligned buffer of its own, and the range handed out as a view of it (its CRC32 taken chunk by chunk as
the reads land, where the caller feeds one). Through the page cache one thread read a checkpoint at a fraction
of what the disk gives by O_DIRECT with 8 threads (docs/design.md, "Checkpoint file I/O"). Where there is no
O_DIRECT, ``read`` answers None.

Writing (``DirectRegionWriter``): a region is cut into pieces on block boundaries of the file, each piece
copied into one of a ring of aligned staging buffers and written by a pool of threads while the next
pieces are copied; the few bytes at a region's unaligned ends go through the page cache. The CRC32 of
each tensor is chained piece by piece on a thread of its own. Beside training, the CRCs and the writes are
made by a helper process from a ring it shares with the rank (``write_helper``), where one can be started;
by threads of the rank otherwise. A checkpoint file keeps its subgroups back
to back (the format needs no padding), so a region rarely starts or ends on a block. Through the page
cache alone one thread wrote at a fraction of what the disk takes by O_DIRECT with 8 threads, and so did
each rank of an independent save on four GPUs: not the disk's pace (docs/design.md, "Checkpoint file
I/O"). The staging ring is small (8 x 16 MiB): a save must not need host memory the size of a subgroup
beside a full host tier. The file is fsynced by the caller.
"""

from __future__ import annotations

import logging
import os
import zlib
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Callable, Dict, List, Optional, Sequence, Tuple

import torch

from ..config.align import ALIGN, align_down, align_up
from .no_fork import aligned_empty
from .to_host import copy_to_host
from .write_helper import WriteHelper, pwrite_all, shared_ring

log = logging.getLogger("mlp_offload")

CHUNK = 8 << 20  # bytes of one read
PIECE = 16 << 20  # bytes of file a staging buffer takes (a multiple of ALIGN)
RING = 8  # staging buffers: up to this many pieces in flight
STAGE = PIECE + ALIGN  # bytes of one staging buffer (a piece may start anywhere in its first block)
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

    def read(self, offset: int, nbytes: int, feed: Optional[Callable[[memoryview], None]] = None
             ) -> Optional[memoryview]:
        """File bytes [offset, offset + nbytes), or None where O_DIRECT is not had; short at the end of
        the file where it is shorter. ``feed`` is given those bytes piece by piece, in file order, as each
        chunk's read lands, while the later chunks are still being read: a check (a CRC: zlib lets go of
        the GIL) that follows the reads rather than one after them."""
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
        got, wanted_end = lo, offset + nbytes
        for a, r in zip(range(lo, hi, CHUNK), reads):
            n = r.result()
            if got != a:  # the file ended in an earlier chunk
                continue
            got = a + n
            first, last = max(a, offset), min(got, wanted_end)
            if feed is not None and last > first:
                feed(view[first - lo: last - lo])
        end = min(wanted_end, got)
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
    ``finish()`` waits for every write. ``helper``: the CRCs and the writes are made by a helper process
    (``write_helper``) from a ring shared with it, where a memfd and a child process can be had (else by
    threads of this process): for a write beside training, whose steps the same work slows less from
    another process. Without it, by threads of this process from a ring in huge pages, the faster way
    when nothing runs beside the write (the memfd's ring has the kernel's small pages)."""

    def __init__(self, fd: int, path: str, threads: int = 8, pace: Optional[Callable[[int], None]] = None,
                 helper: bool = False):
        self.fd = fd
        self.direct = open_direct(path, os.O_WRONLY)  # None where the file system has no O_DIRECT: all through fd
        self.pace = pace  # called with a piece's bytes before it is written (checkpoint.pacing)
        ring = RING if pace is None else PACED_RING
        started = _start_helper(fd, self.direct, ring, threads) if helper else None
        self.helper: Optional[WriteHelper] = started[0] if started is not None else None
        if started is not None:
            whole = torch.frombuffer(started[1], dtype=torch.uint8)  # the shared ring's mapping
            self.ring = [whole[k * STAGE: k * STAGE + STAGE] for k in range(ring)]
        else:
            self.pool = ThreadPoolExecutor(threads, thread_name_prefix="ckpt-write")
            self.crc_thread = ThreadPoolExecutor(1, thread_name_prefix="ckpt-crc")  # in submission order
            self.ring = [aligned_empty(STAGE) for _ in range(ring)]
        self.busy: List[List[Future]] = [[] for _ in range(ring)]  # threads: what still reads each buffer
        self.in_helper: List[bool] = [False] * ring  # helper: whether it may still read each buffer
        self.slots = 0  # helper: CRC chains handed out
        self.crc_values: Dict[int, int] = {}  # helper: the chains' CRCs, once asked for
        self.next = 0  # the ring's buffer the next piece takes

    def put(self, offset: int, tensors: Sequence[torch.Tensor]):
        sources = [t.reshape(-1).view(torch.uint8) for t in tensors]
        bounds, pos = [], offset  # each tensor's file bytes
        for src in sources:
            bounds.append((pos, pos + src.numel()))
            pos += src.numel()
        end, crcs, last = pos, [0] * len(sources), None
        slots = list(range(self.slots, self.slots + len(sources)))
        self.slots += len(sources)
        lo = offset
        while lo < end:
            hi = min(align_down(lo) + PIECE, end)  # pieces end on PIECE boundaries of the file
            k, self.next = self.next, (self.next + 1) % len(self.ring)
            self._free(k)
            stage, lead = self.ring[k], lo % ALIGN  # stage[b] is file byte align_down(lo) + b
            crc_ranges = []
            for j, (a, b) in enumerate(bounds):
                s, e = max(a, lo), min(b, hi)
                if s < e:
                    part = stage[lead + s - lo: lead + e - lo]
                    copy_to_host(part, sources[j][s - a: e - a])  # from the device too
                    if self.helper is not None:
                        crc_ranges.append((slots[j], k * STAGE + lead + s - lo, k * STAGE + lead + e - lo))
                    else:
                        last = self.crc_thread.submit(_chain_crc, crcs, j, memoryview(part.numpy()))
                        self.busy[k].append(last)
            if self.pace is not None:
                self.pace(hi - lo)
            writes = self._writes(lo, hi)
            if self.helper is not None:
                base = k * STAGE - align_down(lo)  # ring offset of file byte 0 for this piece
                self.helper.piece(k, crc_ranges, [(which, base + a, base + b, a) for which, a, b in writes])
                self.in_helper[k] = True
            else:
                view, base, fds = memoryview(stage.numpy()), align_down(lo), (self.fd, self.direct)
                self.busy[k] += [self.pool.submit(pwrite_all, fds[which], view[a - base: b - base], a)
                                 for which, a, b in writes]
            lo = hi
        if self.helper is not None:
            return lambda: self._helper_crcs(slots)
        return lambda: _after(last, crcs)

    def _helper_crcs(self, slots: List[int]) -> List[int]:
        missing = [slot for slot in slots if slot not in self.crc_values]
        if missing:
            self.crc_values.update(zip(missing, self.helper.crcs(missing)))
        return [self.crc_values[slot] for slot in slots]

    def _free(self, k: int) -> None:
        """Wait until nothing reads buffer ``k`` any more (a write's failure is raised here)."""
        if self.in_helper[k]:
            self.helper.wait_done(k)
            self.in_helper[k] = False
        _wait(self.busy[k])

    def _writes(self, lo: int, hi: int) -> List[Tuple[int, int, int]]:
        """File bytes [lo, hi) as writes (which, a, b): which 1 by O_DIRECT (whole blocks), 0 through the
        page cache (the ends off block boundaries, or all of it where the file system has no O_DIRECT)."""
        inner_lo, inner_hi = align_up(lo), align_down(hi)
        if self.direct is None or inner_lo >= inner_hi:
            inner_lo = inner_hi = hi  # nothing direct: all through the page cache
        return [(which, a, b) for which, a, b in ((0, lo, inner_lo), (1, inner_lo, inner_hi), (0, inner_hi, hi))
                if a < b]

    def finish(self) -> None:
        for k in range(len(self.ring)):
            self._free(k)
        if self.helper is not None:  # every CRC now, while the helper runs: they may be asked for after close
            self._helper_crcs(list(range(self.slots)))

    def close(self) -> None:
        if self.helper is not None:
            self.helper.close()
        else:
            self.pool.shutdown(wait=True)
            self.crc_thread.shutdown(wait=True)
        if self.direct is not None:
            os.close(self.direct)
            self.direct = None


def _start_helper(fd: int, direct: Optional[int], ring: int, threads: int):
    """(the helper, the ring's mapping), or None where the platform has no memfd or the helper cannot be
    started (said once in the log: the writes then run in threads of this process)."""
    global _helper_refused
    if _helper_refused or not hasattr(os, "memfd_create"):
        return None
    try:
        ring_fd, region = shared_ring(ring * STAGE)
        try:
            return WriteHelper.start(ring_fd, ring * STAGE, fd, direct, threads), region
        finally:
            os.close(ring_fd)
    except OSError as err:
        _helper_refused = True
        log.warning("checkpoint writes run in threads of the training process: no write helper (%s)", err)
        return None


_helper_refused = False


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
