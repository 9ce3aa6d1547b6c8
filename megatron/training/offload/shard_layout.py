"""This rank's shard of megatron-core's DDP buckets, laid out as the engine's flat index space.

The shard ranges and their order are megatron-core's own (its DistributedOptimizer's range
builder), so the engine updates exactly the elements megatron-core's optimizer would.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass
from typing import Dict, Iterable, List, Tuple

import torch

from megatron.training.runtime.core_private import gbuf_range_map


@dataclass
class Piece:
    """This rank's shard of one DDP bucket: a contiguous range of one buffer."""

    buffer: object  # megatron-core _ParamAndGradBuffer
    buffer_start: int
    flat_start: int  # where it begins in the engine's flat index space
    numel: int


class ShardLayout:
    """The engine's flat index space laid over this rank's bucket shards, in buffer order."""

    def __init__(self, per_model_buffers: Dict[int, list], dp_rank: int, dp_size: int):
        self.pieces: List[Piece] = []
        self.gbuf_ranges = []  # megatron-core's own range maps, same order as its optimizer
        self.param_flat_range: Dict[torch.nn.Parameter, Tuple[int, int]] = {}
        self.param_slice: Dict[torch.nn.Parameter, int] = {}  # where this rank's piece starts in the param
        self.bucket_flat: Dict[object, Tuple[int, int]] = {}  # each DDP bucket's shard in the flat space
        self._buckets: List[object] = []  # each piece's bucket
        flat = 0
        for buffers in per_model_buffers.values():
            for buffer in buffers:
                range_map = gbuf_range_map(buffer)
                self.gbuf_ranges.append(range_map)
                (bucket_maps,) = range_map.values()
                for bucket, bucket_map in zip(buffer.buckets, bucket_maps):
                    shard = bucket.grad_data.numel() // dp_size
                    piece = Piece(buffer, bucket.offset + dp_rank * shard, flat, shard)
                    self.pieces.append(piece)
                    self._buckets.append(bucket)
                    self.bucket_flat[bucket] = (flat, flat + shard)
                    for param, ranges in bucket_map["param_map"].items():
                        world = ranges["gbuf_world"]
                        start = flat + world.start - piece.buffer_start
                        self.param_flat_range[param] = (start, start + world.size)
                        self.param_slice[param] = ranges["param"].start
                    flat += shard
        self.numel = flat
        self.flat_starts = [p.flat_start for p in self.pieces]  # ascending: pieces are laid out in order

    def param_segments(self) -> List[Tuple[int, int, int]]:
        """Where each param's piece lies: ``(flat_start, its first element's index in the param,
        length)`` in flat order, what the engine's 8-bit moments take their blocks from."""
        return sorted((start, self.param_slice[p], end - start) for p, (start, end) in self.param_flat_range.items()
                      if end > start)

    @classmethod
    def of_pieces(cls, pieces: List[Piece]) -> "ShardLayout":
        """A layout of the given pieces alone, in flat order (no model's ranges behind them): their views."""
        layout = cls.__new__(cls)
        layout.pieces, layout.numel = list(pieces), sum(p.numel for p in pieces)
        layout.flat_starts = [p.flat_start for p in layout.pieces]
        return layout

    def views(self, start: int, end: int, kind: str):
        """(flat_start, flat_end, device view) for the pieces overlapping [start, end)."""
        # (from the first piece that may overlap: with many DDP buckets a step asks this per subgroup and per param)
        first = max(0, bisect.bisect_right(self.flat_starts, start) - 1)
        for p in self.pieces[first:]:
            if p.flat_start >= end:
                break
            lo, hi = max(start, p.flat_start), min(end, p.flat_start + p.numel)
            if lo < hi:
                data = p.buffer.param_data if kind == "param" else p.buffer.grad_data
                offset = p.buffer_start + lo - p.flat_start
                yield lo, hi, data[offset: offset + hi - lo]

    def unowned_grads(self):
        """Each bucket's grads outside this rank's shard (other ranks' shards, before their
        reduce-scatter): read by nothing after it; empty at data-parallel size 1."""
        for p, bucket in zip(self.pieces, self._buckets):
            end = bucket.offset + bucket.grad_data.numel()
            for lo, hi in ((bucket.offset, p.buffer_start), (p.buffer_start + p.numel, end)):
                if lo < hi:
                    yield p.buffer.grad_data[lo:hi]

    def flat_ranges(self, params: Iterable[torch.nn.Parameter]) -> List[Tuple[int, int]]:
        """The params' flat ranges, sorted, adjacent ones merged."""
        merged: List[Tuple[int, int]] = []
        for a, b in sorted(self.param_flat_range[p] for p in params):
            if merged and merged[-1][1] == a:
                merged[-1] = (merged[-1][0], b)
            else:
                merged.append((a, b))
        return merged
