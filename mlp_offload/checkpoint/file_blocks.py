"""8-bit moments (``state_formats.Blockwise8``) in a state file: what its footer records so that every
stored subgroup's block layout can be rebuilt, and loads that cross between 8-bit and other moments.

A blockwise region's size and the meaning of its scales depend on where the shard's params lie
(``subgroups.blocks``), so the footer records the shard's param segments and the block size
(``"blocks": {"block": B, "param_segments": [[shard_start, param_start, length], ...]}``) and each
subgroup entry its block count (``"blocks"``, checked against the segments). A reader rebuilds any
range's layout from them (``FileBlocks``)."""

from __future__ import annotations

import logging
from typing import Callable, Optional, Sequence

import torch

from ..kernels.blockwise8 import BlockLayout
from ..state_formats import describe, is_blockwise
from ..subgroups.blocks import ShardParams

log = logging.getLogger("mlp_offload")


class FileBlocks:
    """The blocks of a file's shard: ``params`` (its param segments) and ``block``; layouts of stored
    subgroups are made on demand and the last few kept (8 bytes a block)."""

    KEPT = 4

    def __init__(self, params: ShardParams, block: int):
        self.params, self.block = params, block
        self._layouts = {}

    @classmethod
    def of_footer(cls, footer: dict) -> Optional["FileBlocks"]:
        """The footer's blocks (None where it records none); a ValueError where they are malformed."""
        entry = footer.get("blocks")
        if entry is None:
            return None
        if not (isinstance(entry, dict) and isinstance(entry.get("block"), int) and entry["block"] > 0
                and isinstance(entry.get("param_segments"), list)):
            raise ValueError(f"blocks {str(entry)[:80]}")
        segments = entry["param_segments"]
        if not all(isinstance(s, list) and len(s) == 3 and all(isinstance(v, int) for v in s) for s in segments):
            raise ValueError(f"param segments {str(segments)[:80]}")
        return cls(ShardParams(segments, footer["numel"]), entry["block"])

    def to_json(self) -> dict:
        return {"block": self.block, "param_segments": [list(s) for s in self.params.segments]}

    def count(self, start: int, end: int) -> int:
        """Blocks the elements ``[start, end)`` make."""
        return self.params.blocks_in(start, end, self.block)

    def is_boundary(self, pos: int) -> bool:
        """Whether shard element ``pos`` starts a block (or ends the shard)."""
        return self.params.is_block_start(pos, self.block)

    def layout(self, start: int, end: int) -> BlockLayout:
        """The layout of stored subgroup ``[start, end)``."""
        key = (start, end)
        if key not in self._layouts:
            if len(self._layouts) >= self.KEPT:
                self._layouts.pop(next(iter(self._layouts)))
            self._layouts[key] = self.params.layout(start, end, self.block)
        return self._layouts[key]

    def same_as(self, params: ShardParams, block: int) -> bool:
        return block == self.block and params.segments == self.params.segments


def snapshot_blocks(snapshot) -> Optional[FileBlocks]:
    """What a file of ``snapshot`` records about its blocks (None for element-wise moments)."""
    if not is_blockwise(snapshot.codecs):
        return None
    return FileBlocks(snapshot.shard_params, max(c.block for c in snapshot.codecs))


def moments_change(saved_codecs: Sequence, engine_codecs: Sequence) -> Optional[str]:
    """A one-line notice where a load converts the Adam moments between 8-bit blocks and another
    format (None where it does not): the values move, rounded once more into the new format."""
    saved, mine = tuple(saved_codecs[1:]), tuple(engine_codecs[1:])
    if saved == mine or not (is_blockwise(saved) or is_blockwise(mine)):
        return None
    how = "dequantized" if is_blockwise(saved) and not is_blockwise(mine) else \
        "quantized" if not is_blockwise(saved) else "requantized"
    return (f"the checkpoint's Adam moments are stored as {describe(saved)}, this run's as {describe(mine)}: "
            f"they are {how} as they load (rounded once more; a run that continues in the saved format does not "
            f"differ from one that never stopped)")


def values_fill(engine, fill: Callable) -> Callable:
    """``fill`` (writing fp32 or any float moments, as ``copy_`` converts) as an ``engine.load_state``
    callback: an 8-bit engine's moments are handed to it as fp32 scratch and quantized after, under
    the subgroup's own blocks (an element-wise engine's are handed as they are)."""
    codecs = engine.state_codecs
    if not is_blockwise(codecs):
        return fill
    params, block = engine.blocks.params, engine.blocks.block

    def quantized(sg, param, *moments):
        values = [torch.zeros(sg.numel, dtype=torch.float32) for _ in moments]
        fill(sg, param, *values)
        layout = params.layout(sg.start, sg.end, block)
        for raw, value, codec in zip(moments, values, codecs[1:]):
            codec.pack(value, out=raw, layout=layout)

    return quantized


def note_moments_change(path: str, saved_codecs, engine_codecs) -> None:
    notice = moments_change(saved_codecs, engine_codecs)
    if notice:
        log.warning("%s: %s", path, notice)
