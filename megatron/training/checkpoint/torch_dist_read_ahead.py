"""The torch_dist files read ahead into the page cache while megatron-core reads them at a load.

torch.distributed.checkpoint's FileSystemReader reads each saved item's byte range from one thread,
one after another, waiting for each before it asks for the next: it cannot keep a disk (or a
parallel file system's servers) busy. Beside it a few threads read the same files front to back in
large pieces through the page cache, so that most of megatron-core's reads find their bytes there.

Which files: a node's page cache serves that node's ranks, so each node reads ahead the files
written by the global ranks that run on it (``__<rank>_<k>.distcp``), where at an unchanged layout
those ranks find most of what they read. One rank per node (the lowest global rank there) does the
reading for the whole node, so no two readers on a node fetch the same bytes and no node reads
another node's files: on a shared parallel file system each file is read ahead once, by one node.

Only where it helps: a node skips it where those files exceed a share of its available memory
(MemAvailable), since pages read ahead and evicted before megatron-core asks for them are read twice.
It stops when the torch_dist read ends or fails, and never fails the load: a read-ahead that meets
an error logs one line and ends.
"""

from __future__ import annotations

import logging
import os
import re
import threading
import time
from typing import Iterable, List, Optional, Sequence, Tuple

import torch

from megatron.training.runtime.slurm_env import node_key
from mlp_offload.checkpoint import human_bytes
from mlp_offload import meminfo_bytes

log = logging.getLogger(__name__)

# A few streams in flight keep a disk's queue (or several file servers) busy beside megatron-core's own
# reads; many more would take the node's cores and memory bandwidth that the load itself needs.
READ_AHEAD_THREADS = 4
# Large enough that each read streams at the disk's rate, small enough that a stop waits little.
READ_AHEAD_PIECE_BYTES = 32 << 20
# The files must fit in this share of the node's available memory: the load's own tensors (the model's,
# the offloaded optimizer state's fill) take memory beside them, and pages pushed out early are read twice.
READ_AHEAD_MEMORY_SHARE = 0.5
_DISTCP = re.compile(r"^__(\d+)_(\d+)\.distcp$")

Piece = Tuple[str, int, int]  # (path, byte offset, bytes)


def ranks_on_node(keys: Sequence, rank: int) -> List[int]:
    """The global ranks whose node key (``keys[r]``, every rank's) is ``rank``'s, in order."""
    return [r for r, key in enumerate(keys) if key == keys[rank]]


def files_written_by(names: Iterable[str], ranks: Iterable[int]) -> List[str]:
    """The torch_dist data files among ``names`` written by ``ranks``, each rank's k-th file before
    any rank's (k+1)-th: the order in which the node's ranks, reading at once, tend to reach them."""
    wanted = set(ranks)
    found = []
    for name in names:
        match = _DISTCP.match(name)
        if match and int(match.group(1)) in wanted:
            found.append((int(match.group(2)), int(match.group(1)), name))
    return [name for _, _, name in sorted(found)]


def pieces_of(sizes: Sequence[Tuple[str, int]], piece_bytes: int) -> List[Piece]:
    """Each file's bytes in pieces of at most ``piece_bytes``, file after file, front to back."""
    return [(path, offset, min(piece_bytes, size - offset))
            for path, size in sizes for offset in range(0, size, piece_bytes)]


class FilesReadAhead:
    """Reads ``sizes``' files ([(path, bytes)]) through the page cache on ``threads`` threads, each
    taking the next piece, into a buffer of its own reused for every piece. ``stop()`` ends it (the
    pieces being read finish) and joins the threads; an error ends it too and is kept in ``failure``,
    never raised. ``bytes_read`` and ``seconds``: what it read, and from its start to its end."""

    def __init__(self, sizes: Sequence[Tuple[str, int]], threads: int = READ_AHEAD_THREADS,
                 piece_bytes: int = READ_AHEAD_PIECE_BYTES):
        self.total = sum(size for _, size in sizes)
        self.bytes_read = 0
        self.seconds = 0.0
        self.failure: Optional[str] = None
        self._pieces = pieces_of(sizes, piece_bytes)
        self._piece_bytes = piece_bytes
        self._next = 0
        self._lock = threading.Lock()
        self._stopping = threading.Event()
        self._started = 0.0
        self._ended: List[float] = []
        self.threads = min(threads, len(self._pieces))
        self._threads = [threading.Thread(target=self._run, name=f"ckpt-read-ahead-{i}", daemon=True)
                         for i in range(self.threads)]

    def start(self) -> "FilesReadAhead":
        self._started = time.perf_counter()
        for thread in self._threads:
            thread.start()
        return self

    @property
    def finished(self) -> bool:
        """Whether every byte was read (not stopped early, no error)."""
        return self.bytes_read == self.total and self.failure is None

    def stop(self) -> None:
        """Ends the reading (each thread finishes its piece) and joins the threads; never raises."""
        self._stopping.set()
        for thread in self._threads:
            thread.join()
        if self._threads:
            self.seconds = max(self._ended, default=time.perf_counter()) - self._started

    def read_piece(self, fd: int, buffer: memoryview, offset: int) -> int:
        """Bytes read of ``fd`` at ``offset`` into ``buffer`` (a test counts the reads here)."""
        return os.preadv(fd, [buffer], offset)

    def _take(self) -> Optional[Piece]:
        with self._lock:
            if self._stopping.is_set() or self._next == len(self._pieces):
                return None
            self._next += 1
            return self._pieces[self._next - 1]

    def _run(self) -> None:
        buffer = memoryview(bytearray(self._piece_bytes))
        fd, open_path = -1, None
        try:
            while (piece := self._take()) is not None:
                path, offset, length = piece
                if path != open_path:
                    if fd >= 0:
                        os.close(fd)
                        fd = -1
                    fd, open_path = os.open(path, os.O_RDONLY), path
                got = 0
                while got < length and not self._stopping.is_set():
                    n = self.read_piece(fd, buffer[:length - got], offset + got)
                    if n <= 0:
                        raise EOFError(f"{path} ends before byte {offset + length}")
                    got += n
                with self._lock:
                    self.bytes_read += got
        except Exception as err:  # noqa: BLE001 -- an optimisation's error never fails the load
            with self._lock:
                if self.failure is None:
                    self.failure = f"{type(err).__name__}: {err}"
                    log.warning("torch_dist files' read-ahead stopped: %s", self.failure)
            self._stopping.set()
        finally:
            if fd >= 0:
                os.close(fd)
            with self._lock:
                self._ended.append(time.perf_counter())


class TorchDistReadAhead:
    """``with TorchDistReadAhead(checkpoint_dir, enabled):`` around megatron-core's read of a torch_dist
    checkpoint: on every rank (``enabled`` alike on all: entering gathers every rank's node key), the
    lowest rank of each node reads ahead its node's ranks' files until the block ends or fails.
    ``summary()``: what this rank's node did, for the load's line ('' where not enabled)."""

    def __init__(self, checkpoint_dir: str, enabled: bool = True):
        self.checkpoint_dir, self.enabled = checkpoint_dir, enabled
        self.reading: Optional[FilesReadAhead] = None
        self.skipped: Optional[str] = None  # why this node did not read ahead

    def __enter__(self) -> "TorchDistReadAhead":
        if not self.enabled:
            return self
        keys = [None] * torch.distributed.get_world_size()
        torch.distributed.all_gather_object(keys, node_key())
        node = ranks_on_node(keys, torch.distributed.get_rank())
        try:
            self.reading = self.read_ahead_for(node) if torch.distributed.get_rank() == node[0] else None
        except Exception as err:  # noqa: BLE001 -- an optimisation's error never fails the load
            self.skipped = f"failed to start ({type(err).__name__}: {err})"
            log.warning("torch_dist files not read ahead: %s", self.skipped)
        return self

    def read_ahead_for(self, ranks: Sequence[int]) -> Optional[FilesReadAhead]:
        """Start reading ahead the files of ``ranks``, or say in ``skipped`` why not (None)."""
        names = files_written_by(os.listdir(self.checkpoint_dir), ranks)
        sizes = [(path, os.path.getsize(path)) for path in (os.path.join(self.checkpoint_dir, n) for n in names)]
        total = sum(size for _, size in sizes)
        available = meminfo_bytes("MemAvailable")
        if not sizes:
            self.skipped = "no files of this node's ranks"
        elif available is not None and total > READ_AHEAD_MEMORY_SHARE * available:
            self.skipped = (f"their {human_bytes(total)} exceed {READ_AHEAD_MEMORY_SHARE:.0%} of the "
                            f"node's {human_bytes(available)} of available memory")
        if self.skipped is not None:
            return None
        return FilesReadAhead(sizes).start()

    def __exit__(self, *exc) -> None:
        self.stop()

    def stop(self) -> None:
        if self.reading is not None:
            self.reading.stop()

    def summary(self) -> str:
        if not self.enabled:
            return ""
        if self.reading is None:
            return f"; torch_dist files not read ahead: {self.skipped}" if self.skipped else ""
        done = self.reading
        how = ("failed: " + done.failure if done.failure else
               "whole" if done.finished else f"stopped at the read's end, of {human_bytes(done.total)}")
        return (f"; torch_dist files read ahead on this node: {human_bytes(done.bytes_read)} in {done.seconds:.1f} s "
                f"on {done.threads} threads ({how})")
