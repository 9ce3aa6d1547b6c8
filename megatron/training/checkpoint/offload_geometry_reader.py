"""Read regions of global parameters from a checkpoint's offloaded state, whatever TP/PP wrote it.

Every (pp, tp) position's files record, per parameter, where its local tensor lies in the global
one (param_geometry). A region this run needs is assembled from the saved local tensors that
intersect it, one parameter at a time: memory is bounded by a parameter's rows, not the model.
Saved copies of one global piece (TP-replicated norms, the last stage's tied output layer) are
read once, from the first position holding them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, List, Optional, Sequence, Tuple

import torch

from megatron.training.checkpoint.offload_files import (SUBDIRS, OffloadFileSet, has_offloaded_state,
                                                        saved_model_parallel_sizes)
from megatron.training.checkpoint.param_geometry import ParamGeometry, volume
from mlp_offload.checkpoint import CheckpointDataError


class MissingGeometryError(CheckpointDataError):
    """The checkpoint's offload files predate the recorded geometry: only its own TP/PP loads it."""


@dataclass
class _SavedPiece:
    geometry: ParamGeometry
    files: OffloadFileSet
    name: str  # the parameter's name in those files


class OffloadedStateByGeometry:
    """All (pp, tp) positions' offload files of one checkpoint, read by global region."""

    def __init__(self, checkpoint_dir: str, cache_bytes: Optional[int] = None):
        self.where = checkpoint_dir
        # Every kind's files (dense and experts): with another EP size a parameter may have moved
        # between them (at EP 1 megatron-core keeps experts with the dense parameters).
        grids = {kind: saved_model_parallel_sizes(checkpoint_dir, kind)
                 for kind in SUBDIRS if kind == "dense" or has_offloaded_state(checkpoint_dir, kind)}
        self.pp_size, self.tp_size = grids["dense"]
        self._sets: List[OffloadFileSet] = []
        share = None if cache_bytes is None else cache_bytes // sum(p * t for p, t in grids.values())
        try:
            for kind, (pp_size, tp_size) in grids.items():
                for pp in range(pp_size):
                    for tp in range(tp_size):
                        self._sets.append(OffloadFileSet(checkpoint_dir, pp, tp, share, kind))
            self._pieces, self._shapes = self._index_saved_pieces()
        except BaseException:
            self.close()
            raise
        steps = {files.steps_done for files in self._sets}
        if len(steps) != 1:
            raise CheckpointDataError(f"{checkpoint_dir}: offload files disagree on the step count {sorted(steps)}")
        self.steps_done = steps.pop()
        self.dp_size = self._sets[0].dp_size
        self._warm: List[OffloadFileSet] = []

    def _index_saved_pieces(self):
        pieces: Dict[str, Dict[Tuple, _SavedPiece]] = {}
        shapes: Dict[str, Tuple[int, ...]] = {}
        for files in self._sets:
            if not files.geometry:
                raise MissingGeometryError(
                    f"{self.where}: its offload files record no parameter geometry (saved by an older version)")
            for name, entry in files.geometry.items():
                geometry = ParamGeometry.from_json(entry)
                if geometry is None or name not in files.param_names():
                    raise CheckpointDataError(f"{files.files[0]}: geometry of {name} is malformed: {str(entry)[:80]}")
                if shapes.setdefault(geometry.key, geometry.global_shape) != geometry.global_shape:
                    raise CheckpointDataError(f"{self.where}: offload files disagree on the shape of {geometry.key}")
                where = (geometry.global_offset, geometry.local_shape)
                pieces.setdefault(geometry.key, {}).setdefault(where, _SavedPiece(geometry, files, name))
        return {key: list(by_place.values()) for key, by_place in pieces.items()}, shapes

    def read(self, target: ParamGeometry, start: int, end: int, outs: Sequence[torch.Tensor]) -> None:
        """Elements [start, end) of the local tensor ``target`` describes, into ``outs`` (one per
        stored state). Rows beyond a padded global tensor's saved size (the vocabulary padded for
        another TP size) read as zeros, as megatron-core loads such weights."""
        saved_shape = self._saved_shape(target)
        row = volume(target.local_shape[1:])
        first_row, end_row = start // row, -(-end // row)
        box_offset = (target.global_offset[0] + first_row, *target.global_offset[1:])
        box_shape = (end_row - first_row, *target.local_shape[1:])
        rows = [torch.zeros(box_shape, dtype=torch.float32) for _ in outs]
        covered, used = 0, []
        for piece in self._pieces.get(target.key, []):
            lo = [max(a, b) for a, b in zip(box_offset, piece.geometry.global_offset)]
            hi = [min(a + n, b + m) for a, n, b, m in
                  zip(box_offset, box_shape, piece.geometry.global_offset, piece.geometry.local_shape)]
            if any(x >= y for x, y in zip(lo, hi)):
                continue
            self._copy_intersection(piece, lo, hi, box_offset, rows)
            covered += volume([y - x for x, y in zip(lo, hi)])
            used.append(piece.files)
        inside = volume([max(0, min(o + n, s) - o) for o, n, s in zip(box_offset, box_shape, saved_shape)])
        if covered != inside:
            raise CheckpointDataError(f"{self.where}: {covered} of {inside} elements of {target.key} at "
                                      f"{list(box_offset)} are in its offload files; the checkpoint is incomplete")
        skip = first_row * row
        for out, region in zip(outs, rows):
            out.copy_(region.view(-1)[start - skip: end - skip])
        self._keep_warm(used)

    def _saved_shape(self, target: ParamGeometry) -> Tuple[int, ...]:
        saved = self._shapes.get(target.key)
        if saved is None:
            raise CheckpointDataError(f"{self.where}: no offloaded state for {target.key} (another model?)")
        if saved != target.global_shape and not (target.allow_shape_mismatch and len(saved) == len(target.global_shape)):
            raise CheckpointDataError(f"{self.where}: {target.key} was saved with shape {list(saved)}, this model's is "
                                      f"{list(target.global_shape)} (another model?)")
        return saved

    @staticmethod
    def _copy_intersection(piece: _SavedPiece, lo, hi, box_offset, rows) -> None:
        """The saved rows spanning [lo, hi) are read whole (a parameter's local rows at most), then cut."""
        offset, shape = piece.geometry.global_offset, piece.geometry.local_shape
        row = volume(shape[1:])
        first, last = lo[0] - offset[0], hi[0] - offset[0]
        saved = [torch.empty((last - first) * row, dtype=torch.float32) for _ in rows]
        piece.files.read(piece.name, first * row, last * row, saved)
        source_cut = (slice(None), *(slice(x - o, y - o) for x, y, o in zip(lo[1:], hi[1:], offset[1:])))
        target_cut = tuple(slice(x - o, y - o) for x, y, o in zip(lo, hi, box_offset))
        for region, data in zip(rows, saved):
            region[target_cut].copy_(data.view(last - first, *shape[1:])[source_cut])

    def _keep_warm(self, used: List[OffloadFileSet]) -> None:
        """Only the positions the last read used keep their cached subgroups (the next parameter
        is most likely theirs too): memory stays that of a few subgroups, however many files."""
        for files in self._warm:
            if all(files is not u for u in used):
                files.drop_cached()
        self._warm = used

    def close(self) -> None:
        for files in self._sets:
            files.close()
