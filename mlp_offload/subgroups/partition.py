"""Partition of one rank's flat shard into subgroups, and the byte layout of their state.

A subgroup's state is three tensors (master params, exp_avg, exp_avg_sq), each stored in its own
format (fp32 by default, see ``state_formats``). In host buffers and in files they sit in three
regions, each padded to ALIGN bytes so O_DIRECT I/O can use them as-is.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import List, Optional, Sequence, Tuple

from ..state_formats import FP32, STATE_TENSORS, StateCodec
from .blocks import ShardParams, cut_on_blocks
from ..config.align import align_up

FP32_BYTES = 4
__all__ = ["STATE_TENSORS", "FP32_BYTES", "Subgroup", "partition"]


@dataclass(frozen=True)
class Subgroup:
    index: int
    start: int  # element offset in the rank's flat shard
    end: int
    codecs: Tuple[StateCodec, StateCodec, StateCodec] = (FP32,) * 3  # the stored format of each state tensor
    # Blocks its elements make for a blockwise format (``blocks.ShardParams.blocks_in``); None: whole
    # blocks from its first element (one param).
    blocks: Optional[int] = None

    @property
    def numel(self) -> int:
        return self.end - self.start

    def region_bytes(self, k: int) -> int:
        """Bytes of state region ``k`` (STATE_TENSORS order), padded for O_DIRECT."""
        return align_up(self.codecs[k].stored_bytes(self.numel, self.blocks))

    def narrow(self, k: int, stored):
        """Its own part of state tensor ``k`` stored in a buffer sized for at least as much."""
        return self.codecs[k].narrow(stored, self.numel, self.blocks)

    def region_offset(self, k: int) -> int:
        """Where region ``k`` starts in the subgroup's file or host buffer."""
        return sum(self.region_bytes(j) for j in range(k))

    @property
    def state_bytes(self) -> int:
        """Bytes its whole state occupies in a file or a host buffer (three padded regions)."""
        return self.region_offset(len(STATE_TENSORS))


def partition(numel: int, subgroup_size: int, codecs: Sequence[StateCodec] = (FP32,) * 3,
              params=None) -> List[Subgroup]:
    """Split ``numel`` elements into subgroups of ``subgroup_size`` (the last one shorter). With a
    blockwise format, ``params`` (``blocks.ShardParams``) places the blocks: each subgroup then ends
    on a block start (at most a block past ``subgroup_size``)."""
    if numel <= 0:
        raise ValueError(f"cannot partition an empty shard (numel={numel})")
    if subgroup_size <= 0:
        raise ValueError(f"subgroup size must be positive, got {subgroup_size}")
    block = max(c.block for c in codecs)
    if not block:
        return [
            Subgroup(i, start, min(start + subgroup_size, numel), tuple(codecs))
            for i, start in enumerate(range(0, numel, subgroup_size))
        ]
    params = params if params is not None else ShardParams([], numel)
    return [Subgroup(i, a, b, tuple(codecs), params.blocks_in(a, b, block))
            for i, (a, b) in enumerate(cut_on_blocks(params, subgroup_size, block))]


def slot_subgroup(subgroups: Sequence[Subgroup]) -> Subgroup:
    """A subgroup as large as any of ``subgroups`` in elements and in blocks: what a buffer that
    holds any one of them is sized for."""
    first = subgroups[0]
    if first.blocks is None:
        return max(subgroups, key=lambda sg: sg.numel)
    return Subgroup(-1, 0, max(sg.numel for sg in subgroups), first.codecs, max(sg.blocks for sg in subgroups))
