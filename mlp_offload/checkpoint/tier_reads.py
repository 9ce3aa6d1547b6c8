"""The file-held subgroups of a snapshot read back through their tiers for a checkpoint writer (``write``): to be
written into the checkpoint, or, where the checkpoint links their files, for the resume check's digest.

In the writer's order, the next one into the other of two buffers while this one is used. A paced writer's
(``pacing.DiskPacer``) go in pieces of at most ``direct_io.PIECE`` bytes, each after its turn on the pacer, two in
flight, as the writer's own writes do: read whole, a subgroup would go as one burst at the disk's rate once its
turn came, in front of the tier's next operations.
"""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Dict, List, Optional

from .pacing import DiskPacer
from ..pipeline import StateViews
from ..snapshot import StateSnapshot
from ..tiers.direct_io import PACED_RING, PIECE
from ..tiers.no_fork import aligned_empty


class TierReads:
    """The file-held subgroups read through their tiers in the writer's order, the next one into
    the other of two buffers while this one is written. Paced (``pacer``): each read goes in pieces of at most
    ``PIECE`` bytes, each after its turn, two in flight, by a thread of its own; a tier operation that starts
    meanwhile then waits behind two pieces, not a whole subgroup (which went as one burst at the disk's rate)."""

    def __init__(self, snapshot: StateSnapshot, skip=(), pacer: Optional[DiskPacer] = None):
        self.snapshot = snapshot
        self.pacer = pacer  # each read waits its turn on the disk as a chunk of the writer's does
        self.ids = [i for i in snapshot.order if i in snapshot.on_tier and i not in skip]
        self.buffers: List[StateViews] = []
        self.pending: Dict[int, object] = {}
        self.next = 0
        self._closing = threading.Event()
        self._paced = ThreadPoolExecutor(1, thread_name_prefix="mlp-checkpoint-tier-read") if pacer else None

    def get(self, i: int) -> StateViews:
        if not self.pending:
            self._issue()
        k, future = self.pending.pop(i)
        future.result()
        self._issue()  # into the other buffer, which held the subgroup written last
        return self.buffers[k % 2]

    def close(self) -> None:
        """The paced reads stop after their piece in flight; their thread ends."""
        self._closing.set()
        if self._paced is not None:
            self._paced.shutdown(wait=True)

    def _issue(self) -> None:
        if self.next >= len(self.ids):
            return
        k, i = self.next, self.ids[self.next]
        self.next += 1
        if len(self.buffers) <= k % 2:
            largest = self.snapshot.largest
            self.buffers.append(StateViews.over(aligned_empty(largest.state_bytes), largest))
        copy, sg = self.snapshot.on_tier[i], self.snapshot.subgroups[i]
        extents = self.buffers[k % 2].extents(sg)
        if self._paced is None:
            self.pending[i] = (k, copy.tier.submit_read(copy.key, extents, background=True))
        else:
            self.pending[i] = (k, self._paced.submit(self._read_in_pieces, copy, extents))

    def _read_in_pieces(self, copy, extents) -> None:
        in_flight: List = []
        for first_block, piece in tier_pieces(extents, copy.tier.block_bytes, PIECE):
            if self._closing.is_set():
                break
            self.pacer.wait_turn(piece[1].numel())
            if len(in_flight) == PACED_RING:
                in_flight.pop(0).result()
            in_flight.append(copy.tier.submit_read(copy.key, [piece], background=True, first_block=first_block))
        for future in in_flight:
            future.result()


def tier_pieces(extents, block_bytes: int, piece_bytes: int):
    """``extents`` (file offset, buffer) cut into pieces of whole blocks of at most ``piece_bytes`` (one block at
    least), as a file tier lays its blocks out (each extent's from its start): (the piece's first block's number in
    the file, (its file offset, its part of the buffer))."""
    per_piece = max(1, piece_bytes // block_bytes)
    first = 0
    for file_offset, buf in extents:
        n = buf.numel()
        blocks = -(-n // block_bytes)
        for b in range(0, blocks, per_piece):
            lo, hi = b * block_bytes, min(n, (b + per_piece) * block_bytes)
            yield first + b, (file_offset + lo, buf[lo:hi])
        first += blocks
