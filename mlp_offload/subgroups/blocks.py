"""Where the shard's params lie, and the blocks of 8-bit moments that follow from it.

A blockwise moment format (``state_formats.Blockwise8``) cuts each param into blocks of its own
indices (``kernels.blockwise8``), so the engine must know which element of which param each shard
element is: ``ShardParams``, segments ``(shard_start, param_start, length)`` tiling the shard (the
Megatron adapter gives them from megatron-core's bucket shards; an engine given none takes each
param-group range as one param from its first element, the rest as padding). Subgroups are cut on
block starts (``next_block_start``): a subgroup's bits then do not depend on where
``subgroup_size`` cuts. ``SubgroupBlocks`` gives each subgroup's param-group pieces with their block
layouts, built at first use and kept (8 bytes per block: 0.0625 byte per element at blocks of 128).
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass
from typing import Dict, List, Optional, Sequence, Tuple

from ..kernels.blockwise8 import BlockLayout

ParamSegment = Tuple[int, int, int]  # (shard_start, param_start, length)


class ShardParams:
    """The shard's params as segments tiling ``[0, numel)`` in order (gaps are padding: a segment of
    their own from param element 0)."""

    def __init__(self, segments: Sequence[ParamSegment], numel: int):
        tiled, at = [], 0
        for shard_start, param_start, length in sorted((int(a), int(b), int(c)) for a, b, c in segments):
            if length < 1 or param_start < 0 or shard_start < at or shard_start + length > numel:
                raise ValueError(f"param segment ({shard_start}, {param_start}, {length}): segments must lie in the "
                                 f"shard of {numel} elements without overlapping, with positive lengths")
            if shard_start > at:
                tiled.append((at, 0, shard_start - at))
            tiled.append((shard_start, param_start, length))
            at = shard_start + length
        if at < numel:
            tiled.append((at, 0, numel - at))
        self.segments = tiled
        self.numel = numel
        self._starts = [s for s, _, _ in tiled]

    @classmethod
    def of_ranges(cls, ranges: Sequence[Tuple[int, int]], numel: int) -> "ShardParams":
        """Each range one param from its first element."""
        return cls([(a, 0, b - a) for a, b in ranges], numel)

    def _at(self, pos: int) -> int:
        return bisect.bisect_right(self._starts, pos) - 1

    def next_block_start(self, pos: int, block: int) -> int:
        """The first block start at or after shard element ``pos`` (``numel`` at the end)."""
        if pos >= self.numel:
            return self.numel
        shard_start, param_start, length = self.segments[self._at(pos)]
        if pos == shard_start:  # a segment starts a block of its own (the shard may cut its param's block)
            return pos
        p = param_start + pos - shard_start
        return shard_start + min(length, -(-p // block) * block - param_start)

    def is_block_start(self, pos: int, block: int) -> bool:
        return self.next_block_start(pos, block) == pos

    def clipped(self, start: int, end: int) -> List[ParamSegment]:
        """The segments of elements ``[start, end)``, with shard positions from ``start``."""
        out = []
        for k in range(max(0, self._at(start)), len(self.segments)):
            shard_start, param_start, length = self.segments[k]
            lo, hi = max(start, shard_start), min(end, shard_start + length)
            if lo >= end:
                break
            if lo < hi:
                out.append((lo - start, param_start + lo - shard_start, hi - lo))
        return out

    def layout(self, start: int, end: int, block: int) -> BlockLayout:
        """The block layout of elements ``[start, end)`` (both ends block starts), from ``start``."""
        return BlockLayout(self.clipped(start, end), block)

    def blocks_in(self, start: int, end: int, block: int) -> int:
        """Blocks the elements ``[start, end)`` make (both ends block starts)."""
        return sum((p + n + block - 1) // block - p // block for _, p, n in self.clipped(start, end))


def cut_on_blocks(params: ShardParams, subgroup_size: int, block: int) -> List[Tuple[int, int]]:
    """Subgroup ranges of about ``subgroup_size`` elements, each ending on a block start."""
    ranges, start = [], 0
    while start < params.numel:
        end = params.next_block_start(min(params.numel, start + subgroup_size), block)
        ranges.append((start, end))
        start = end
    return ranges


@dataclass(frozen=True)
class BlockPiece:
    """One param group's piece of a subgroup: elements ``[lo, hi)`` and blocks ``[first, last)`` of
    the subgroup, group ``g``, and its own block layout."""

    lo: int
    hi: int
    g: int
    first: int
    last: int
    layout: BlockLayout


class SubgroupBlocks:
    """Each subgroup's pieces (``BlockPiece``) for the 8-bit kernels, built at first use and kept.
    ``segments[i]``: subgroup ``i``'s param-group pieces (``param_groups.segments_of``); every piece
    must start and end on a param's block start (megatron-core's groups hold whole params)."""

    def __init__(self, params: ShardParams, subgroups, segments, block: int):
        self.params, self.subgroups, self.segments, self.block = params, subgroups, segments, block
        self._pieces: Dict[int, List[BlockPiece]] = {}
        for sg, segs in zip(subgroups, segments):
            for lo, hi, g, _ in segs:
                for end in (sg.start + lo, sg.start + hi):
                    if not params.is_block_start(end, block):
                        raise ValueError(f"param group {g} has a range edge at shard element {end}, inside a param's "
                                         f"block of {block}: with 8-bit moments a group holds whole params")

    def pieces(self, i: int) -> List[BlockPiece]:
        got = self._pieces.get(i)
        if got is None:
            got = self._pieces[i] = pieces_of(self.params, self.subgroups[i].start, self.segments[i], self.block)
        return got


def pieces_of(params: ShardParams, base: int, segments, block: int) -> List[BlockPiece]:
    """The ``BlockPiece``s of the param-group ``segments`` of a subgroup starting at shard element ``base``."""
    out, first = [], 0
    covered = 0
    for lo, hi, g, _ in segments:
        first += params.blocks_in(base + covered, base + lo, block)  # padding between groups
        layout = BlockLayout(params.clipped(base + lo, base + hi), block)
        out.append(BlockPiece(lo, hi, g, first, first + layout.blocks, layout))
        first += layout.blocks
        covered = hi
    return out


def shard_params_for(segments: Optional[Sequence[ParamSegment]], group_ranges, numel: int) -> ShardParams:
    """The model's param segments where the caller gave them, else each group range as one param."""
    if segments is not None:
        return ShardParams(segments, numel)
    return ShardParams.of_ranges(sorted(r for ranges in group_ranges for r in ranges), numel)

