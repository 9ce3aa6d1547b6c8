"""A checkpoint's offloaded optimizer state read by this run's parameters, whatever layout wrote it.

One reader, three ways, the first that fits (the index, saved_offload, knows which):
- whole file: the same TP/PP/chunks/EP and DP size: this rank's own file fills its engine as saved;
- by name: the same TP/PP/chunks/EP, another DP size: each parameter from its (pp, tp) position's
  files, by the name they record;
- by region: otherwise: each parameter's global region (param_geometry) assembled from the saved
  pieces that intersect it, one parameter's rows at a time, so memory is bounded by a parameter,
  not the model. Saved copies of one global piece (TP-replicated norms, the tied output layer) are
  read once, from the first position holding them.
The offload engine and megatron-core's own optimizer both fill themselves through ``read``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, List, Optional, Sequence, Tuple

import torch

from megatron.training.checkpoint.format import sharding_metadata
from megatron.training.checkpoint.param_geometry import ParamGeometry, param_geometries, volume
from megatron.training.checkpoint.saved_offload import (ModelParallelLayout, SavedOffloadState, SavedPosition,
                                                        param_names, shard_coordinates)
from mlp_offload.checkpoint import CheckpointDataError, StateFile


@dataclass
class _SavedPiece:
    geometry: ParamGeometry
    position: SavedPosition
    name: str  # the parameter's name in its files


class OffloadedStateReader:
    """This rank's view of ``saved`` for its ``kind`` of parameters (dense or experts).
    ``cache_bytes`` bounds the stored subgroups the file readers keep (None: two per file)."""

    def __init__(self, saved: SavedOffloadState, model_chunks, kind: str = "dense",
                 cache_bytes: Optional[int] = None):
        (pp, tp, _), self._place, ep = shard_coordinates(kind)
        self.saved, self.kind, self.model_chunks, self.cache_bytes = saved, kind, model_chunks, cache_bytes
        # This rank's own file, where saved, is read in every way: opened first, it describes the layout too.
        saved.own_file(kind, *self._place)
        # Experts saved at EP 1 are in the dense files (megatron-core keeps them there): described by those.
        self.saved_layout = saved.layout(kind if saved.has(kind) else "dense")
        self.layout = ModelParallelLayout(kind, pp, tp, len(model_chunks), ep)
        self.by_name = self.saved_layout == self.layout
        self.names = param_names(model_chunks)
        self._position: Optional[SavedPosition] = None  # by name: this rank's (pp, tp) position
        # by region, made on the first read: this run's params' places, the saved pieces and global shapes
        self._param_geometry: Dict[torch.nn.Parameter, ParamGeometry] = {}
        self._regions: Optional[Dict[str, List[_SavedPiece]]] = None
        self._shapes: Dict[str, Tuple[int, ...]] = {}
        self._warm: List[SavedPosition] = []

    def whole_file(self, dp_size: int) -> Optional[StateFile]:
        """This rank's own file where it was saved at this very layout and DP size, else None."""
        if not self.by_name:
            return None
        own = self.saved.own_file(self.kind, *self._place)
        return own if own is not None and own.metadata["dp_size"] == dp_size else None

    def read(self, param, start: int, end: int, outs) -> None:
        """Elements [start, end) of ``param`` (flat, in this rank's local tensor) into ``outs``,
        one float32 tensor per stored state (saved_offload.STATE_KEYS)."""
        if self.by_name:
            if self._position is None:
                self._position = self.saved.position(self.kind, *self._place[:2], cache_bytes=self.cache_bytes)
            # The model's loaded params complete masters saved as remainders (same elements: same layout).
            high = param.detach().view(-1)[start:end] if param.dtype == torch.bfloat16 else None
            self._position.read(self.names[param], start, end, outs, high)
            return
        geometry = self._geometries().get(param)
        if geometry is None:
            raise CheckpointDataError(f"{self.saved.where}: megatron-core gives no plain sharded tensor for "
                                      f"{self.names[param]}, so its offloaded state cannot be resharded across TP/PP")
        self._read_region(geometry, start, end, outs)

    def describe_change(self, dp_size: int) -> str:
        """From which layout to which the state was read."""
        if self.by_name:  # (a shard holding no parameter read nothing, so its position may be unopened)
            return f"data-parallel size {self.saved.position(self.kind, *self._place[:2]).dp_size} to {dp_size}"
        saved_dp = self.saved.position(self.saved_layout.kind, 0, 0).dp_size
        return f"{self.saved_layout.words()} DP={saved_dp} to {self.layout.words()} DP={dp_size}"

    def drop_cached(self) -> None:
        """Forget the stored subgroups its positions keep (once this reader is done)."""
        for position in [self._position, *self._warm]:
            if position is not None:
                position.drop_cached()

    # -- by region ----------------------------------------------------------------------------------
    def _geometries(self) -> Dict[torch.nn.Parameter, ParamGeometry]:
        if self._regions is None:
            self._param_geometry = param_geometries(self.model_chunks, sharding_metadata())
            self._regions, self._shapes = self._index_saved_pieces()
        return self._param_geometry

    def _index_saved_pieces(self):
        """Every kind's positions (with another EP size a parameter may have moved between the dense
        and the experts' files), each piece by its global key and place."""
        where = [(kind, pp, tp) for kind in self.saved.kinds() for pp, tp in self.saved.positions(kind)]
        share = None if self.cache_bytes is None else self.cache_bytes // len(where)
        pieces: Dict[str, Dict[Tuple, _SavedPiece]] = {}
        shapes: Dict[str, Tuple[int, ...]] = {}
        for kind, pp, tp in where:
            position = self.saved.position(kind, pp, tp, cache_bytes=share)
            for name, entry in position.geometry.items():
                geometry = ParamGeometry.from_json(entry)
                if geometry is None or name not in position.param_names():
                    raise CheckpointDataError(f"{position.files[0].path}: geometry of {name} is malformed: "
                                              f"{str(entry)[:80]}")
                if shapes.setdefault(geometry.key, geometry.global_shape) != geometry.global_shape:
                    raise CheckpointDataError(f"{self.saved.where}: offload files disagree on the shape of "
                                              f"{geometry.key}")
                place = (geometry.global_offset, geometry.local_shape)
                pieces.setdefault(geometry.key, {}).setdefault(place, _SavedPiece(geometry, position, name))
        return {key: list(by_place.values()) for key, by_place in pieces.items()}, shapes

    def _read_region(self, target: ParamGeometry, start: int, end: int, outs: Sequence[torch.Tensor]) -> None:
        """Elements [start, end) of the local tensor ``target`` describes. Rows beyond a padded global
        tensor's saved size (the vocabulary padded for another TP size) read as zeros, as
        megatron-core loads such weights."""
        saved_shape = self._saved_shape(target)
        row = volume(target.local_shape[1:])
        first_row, end_row = start // row, -(-end // row)
        box_offset = (target.global_offset[0] + first_row, *target.global_offset[1:])
        box_shape = (end_row - first_row, *target.local_shape[1:])
        rows = [torch.zeros(box_shape, dtype=torch.float32) for _ in outs]
        covered, used = 0, []
        for piece in self._regions.get(target.key, []):
            lo = [max(a, b) for a, b in zip(box_offset, piece.geometry.global_offset)]
            hi = [min(a + n, b + m) for a, n, b, m in
                  zip(box_offset, box_shape, piece.geometry.global_offset, piece.geometry.local_shape)]
            if any(x >= y for x, y in zip(lo, hi)):
                continue
            _copy_intersection(piece, lo, hi, box_offset, rows)
            covered += volume([y - x for x, y in zip(lo, hi)])
            used.append(piece.position)
        inside = volume([max(0, min(o + n, s) - o) for o, n, s in zip(box_offset, box_shape, saved_shape)])
        if covered != inside:
            raise CheckpointDataError(f"{self.saved.where}: {covered} of {inside} elements of {target.key} at "
                                      f"{list(box_offset)} are in its offload files; the checkpoint is incomplete")
        skip = first_row * row
        for out, region in zip(outs, rows):
            out.copy_(region.view(-1)[start - skip: end - skip])
        self._keep_warm(used)

    def _saved_shape(self, target: ParamGeometry) -> Tuple[int, ...]:
        saved = self._shapes.get(target.key)
        if saved is None:
            raise CheckpointDataError(f"{self.saved.where}: no offloaded state for {target.key} (another model?)")
        if saved != target.global_shape and not (target.allow_shape_mismatch and len(saved) == len(target.global_shape)):
            raise CheckpointDataError(f"{self.saved.where}: {target.key} was saved with shape {list(saved)}, this "
                                      f"model's is {list(target.global_shape)} (another model?)")
        return saved

    def _keep_warm(self, used: List[SavedPosition]) -> None:
        """Only the positions the last read used keep their cached subgroups (the next parameter
        is most likely theirs too): memory stays that of a few subgroups, however many files."""
        for position in self._warm:
            if all(position is not u for u in used):
                position.drop_cached()
        self._warm = used


def _copy_intersection(piece: _SavedPiece, lo, hi, box_offset, rows) -> None:
    """The saved rows spanning [lo, hi) are read whole (a parameter's local rows at most), then cut."""
    offset, shape = piece.geometry.global_offset, piece.geometry.local_shape
    row = volume(shape[1:])
    first, last = lo[0] - offset[0], hi[0] - offset[0]
    saved = [torch.empty((last - first) * row, dtype=torch.float32) for _ in rows]
    piece.position.read(piece.name, first * row, last * row, saved)
    source_cut = (slice(None), *(slice(x - o, y - o) for x, y, o in zip(lo[1:], hi[1:], offset[1:])))
    target_cut = tuple(slice(x - o, y - o) for x, y, o in zip(lo, hi, box_offset))
    for region, data in zip(rows, saved):
        region[target_cut].copy_(data.view(last - first, *shape[1:])[source_cut])
