"""A checkpoint's offloaded optimizer state read back by this run's parameters, whatever layout
wrote it: one class, ``SavedOffloadState``, made once per load, with one face, ``read``.

It lists each offload directory once and opens a file only when first asked about it, once: its
footer is read and checked then (the step count against the checkpoint's, the slices against the
file's elements), and the same open file later serves its data. A read of this run's parameter
goes the first way that fits:
- whole file: the same TP/PP/chunks/EP and DP size: this rank's own file fills its engine as saved
  (``whole_file``);
- by name: the same TP/PP/chunks/EP, another DP size: each parameter from its (pp, tp) position's
  files, by the name they record;
- by region: otherwise: each parameter's global region (its ParamGeometry) assembled from the saved
  pieces that intersect it, one parameter's rows at a time, so memory is bounded by a parameter,
  not the model. Saved copies of one global piece (TP-replicated norms, the tied output layer) are
  read once, from the first position holding them.
The offload engines (``optimizer_state.OffloadedStateLoad``, through the engine's face) and megatron-core's
own optimizer (crossing) both fill themselves through ``read``; a position's files are an
``offload_files.PositionFiles``.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from typing import Dict, List, Optional, Sequence, Tuple

import torch

from megatron.training.checkpoint.offload_files import (FILE_NAME, SUBDIRS, ParamGeometry, PositionFiles,
                                                        param_geometries, param_names, shard_coordinates, volume)
from megatron.training.checkpoint.state_dict import sharding_metadata
from mlp_offload.checkpoint import BlockLayout, CheckpointDataError, Quantized, StateFile, quantize, stored_codecs

log = logging.getLogger("mlp_offload")


@dataclass(frozen=True)
class ModelParallelLayout:
    """What decides which global pieces a (pp, tp) position's parameters are: equal layouts name the
    same pieces alike, whatever the DP size."""
    kind: str
    pp: int
    tp: int
    chunks: int  # model chunks per rank (the interleaved pipeline's V, else 1)
    ep: int

    def words(self) -> str:
        grid = "TP" if self.kind == "dense" else "EPxETP"
        return (f"{grid}={self.tp} PP={self.pp}" + (f" VPP={self.chunks}" if self.chunks > 1 else "")
                + (f" EP={self.ep}" if self.ep > 1 else ""))


@dataclass(frozen=True)
class _RunShard:
    """How this run's parameters of one kind find theirs in the saved files."""
    place: Tuple[int, int, int]  # this rank's (pp, tp, dp), as files of its kind are keyed
    saved_layout: ModelParallelLayout
    layout: ModelParallelLayout

    @property
    def by_name(self) -> bool:
        """Equal layouts name the same pieces alike, whatever the DP size."""
        return self.saved_layout == self.layout


class SavedOffloadState:
    """``checkpoint_dir``'s offloaded optimizer state. ``steps_done``: the step count the checkpoint's
    common state gives (None: the first file read sets it); every file must agree. ``model_chunks``:
    this run's (DDP-wrapped) model, whose parameters ``read`` takes; ``cache_bytes`` bounds the
    stored subgroups the files' readers keep (None: two per file). Close it when the load is done:
    it holds the files it opened."""

    def __init__(self, checkpoint_dir: str, steps_done: Optional[int] = None, model_chunks=None,
                 cache_bytes: Optional[int] = None):
        self.where = checkpoint_dir
        self.steps_done = steps_done
        self.model_chunks, self.cache_bytes = model_chunks, cache_bytes
        # kind -> (pp, tp) -> dp -> path: each directory listed once
        self._paths = {kind: self._list(sub) for kind, sub in SUBDIRS.items()}
        self._open: Dict[str, StateFile] = {}
        self._positions: Dict[Tuple[str, int, int], PositionFiles] = {}
        self._run: Dict[str, _RunShard] = {}  # kind -> how this run's parameters of that kind are read
        self._names: Optional[Dict[torch.nn.Parameter, str]] = None
        # by region, made on the first such read: this run's params' places, the saved pieces and global shapes
        self._param_geometry: Dict[torch.nn.Parameter, ParamGeometry] = {}
        self._regions: Optional[Dict[str, List[_SavedPiece]]] = None
        self._shapes: Dict[str, Tuple[int, ...]] = {}
        self._warm: List[PositionFiles] = []

    # -- reading by this run's parameters ----------------------------------------------------------
    def read(self, kind: str, param, start: int, end: int, outs) -> None:
        """Elements [start, end) of ``param`` (flat, in this rank's local tensor; one of ``kind``'s,
        dense or experts) into ``outs``, one float32 tensor per stored state (STATE_KEYS)."""
        run = self._run_shard(kind)
        if run.by_name:
            position = self.position(kind, *run.place[:2], cache_bytes=self.cache_bytes)
            # The model's loaded params complete masters saved as remainders (same elements: same layout).
            high = param.detach().view(-1)[start:end] if param.dtype == torch.bfloat16 else None
            position.read_by_name(self._param_names()[param], start, end, outs, high)
            return
        geometry = self._geometries().get(param)
        if geometry is None:
            raise CheckpointDataError(f"{self.where}: megatron-core gives no plain sharded tensor for "
                                      f"{self._param_names()[param]}, so its offloaded state cannot be resharded "
                                      f"across TP/PP")
        self._read_region(geometry, start, end, outs)

    def read_eight_bit(self, kind: str, param, start: int, end: int, master: torch.Tensor,
                       moments: Sequence[Quantized], layout: BlockLayout) -> None:
        """As ``read``, for an engine with 8-bit moments: the master into ``master`` (float32), the
        moments into ``moments`` (codes and scales laid out by ``layout``). By name, block-aligned
        stretches keep their codes and scales (``PositionFiles.read_moments_by_name``); by region
        (another TP/PP/EP), so too where a saved piece is this very tensor (the same global place and
        shape: e.g. another PP size only), else the parameter is another tensor with other blocks and
        its moments are quantized from values."""
        run = self._run_shard(kind)
        if run.by_name:
            self.read(kind, param, start, end, [master])
            position = self.position(kind, *run.place[:2], cache_bytes=self.cache_bytes)
            position.read_moments_by_name(self._param_names()[param], start, end, moments, layout)
            return
        same = self._same_piece(param)
        if same is not None:
            self.read(kind, param, start, end, [master])
            same.position.read_moments_by_name(same.name, start, end, moments, layout)
            return
        values = [torch.empty(end - start, dtype=torch.float32) for _ in moments]
        self.read(kind, param, start, end, [master, *values])
        for value, target in zip(values, moments):
            quantize(value, layout, target.fmt, out=target)

    def saved_codecs(self, kind: str):
        """How the files this run's ``kind`` reads store (master, exp_avg, exp_avg_sq) (one save: all alike)."""
        grid = self._grid(self._run_shard(kind).saved_layout.kind)
        return stored_codecs(self.file(min(path for files in grid.values() for path in files.values())).footer)

    def whole_file(self, kind: str, dp_size: int) -> Optional[StateFile]:
        """This rank's own file of ``kind`` where it was saved at this very layout and DP size, else None."""
        run = self._run_shard(kind)
        if not run.by_name:
            return None
        own = self.own_file(kind, *run.place)
        return own if own is not None and own.metadata["dp_size"] == dp_size else None

    def describe_change(self, kind: str, dp_size: int) -> str:
        """From which layout to which ``kind``'s state was read."""
        run = self._run_shard(kind)
        if run.by_name:  # (a shard holding no parameter read nothing, so its position may be unopened)
            return f"data-parallel size {self.position(kind, *run.place[:2]).dp_size} to {dp_size}"
        saved_dp = self.position(run.saved_layout.kind, 0, 0).dp_size
        return f"{run.saved_layout.words()} DP={saved_dp} to {run.layout.words()} DP={dp_size}"

    def drop_cached(self) -> None:
        """Forget the stored subgroups the positions keep (once a reading is done)."""
        for position in self._positions.values():
            position.drop_cached()
        self._warm = []

    def _run_chunks(self):
        if self.model_chunks is None:
            raise ValueError(f"{self.where}: reading by this run's parameters needs the model_chunks argument")
        return self.model_chunks

    def _param_names(self) -> Dict[torch.nn.Parameter, str]:
        if self._names is None:
            self._names = param_names(self._run_chunks())
        return self._names

    def _run_shard(self, kind: str) -> "_RunShard":
        if kind not in self._run:
            (pp, tp, _), place, ep = shard_coordinates(kind)
            # This rank's own file, where saved, is read in every way: opened first, it describes the layout too.
            self.own_file(kind, *place)
            # Experts saved at EP 1 are in the dense files (megatron-core keeps them there): described by those.
            saved_layout = self.layout(kind if self.has(kind) else "dense")
            layout = ModelParallelLayout(kind, pp, tp, len(self._run_chunks()), ep)
            self._run[kind] = _RunShard(place, saved_layout, layout)
        return self._run[kind]

    # -- what was saved -----------------------------------------------------------------------------
    def _list(self, subdir: str) -> Dict[Tuple[int, int], Dict[int, str]]:
        folder = os.path.join(self.where, subdir)
        try:
            names = os.listdir(folder)
        except FileNotFoundError:
            return {}
        grid: Dict[Tuple[int, int], Dict[int, str]] = {}
        for name in names:
            match = FILE_NAME.match(name)
            if match:
                pp, tp, dp = (int(g) for g in match.groups())
                grid.setdefault((pp, tp), {})[dp] = os.path.join(folder, name)
        return grid

    def has(self, kind: str) -> bool:
        return bool(self._paths[kind])

    def kinds(self) -> List[str]:
        return [kind for kind in SUBDIRS if self.has(kind)]

    def layout(self, kind: str) -> ModelParallelLayout:
        """The layout that wrote ``kind``'s files: (PP, TP) from their names; chunks and EP size from
        a footer (every file records them: one already open, else the first)."""
        grid = self._grid(kind)
        paths = [path for files in grid.values() for path in files.values()]
        some = self.file(next((path for path in paths if path in self._open), min(paths)))
        return ModelParallelLayout(kind, max(p for p, _ in grid) + 1, max(t for _, t in grid) + 1,
                                   some.metadata["model_chunks"], some.metadata["ep_size"])

    def positions(self, kind: str) -> List[Tuple[int, int]]:
        return sorted(self._grid(kind))

    def _grid(self, kind: str) -> Dict[Tuple[int, int], Dict[int, str]]:
        if not self._paths[kind]:
            raise CheckpointDataError(f"{self.where}: no offloaded optimizer state (no {SUBDIRS[kind]}/*.offload "
                                      f"files)")
        return self._paths[kind]

    # -- its files --------------------------------------------------------------------------------
    def own_file(self, kind: str, pp: int, tp: int, dp: int) -> Optional[StateFile]:
        """The file of position (pp, tp, dp), or None where none was saved."""
        path = self._paths[kind].get((pp, tp), {}).get(dp)
        return None if path is None else self.file(path)

    def position(self, kind: str, pp: int, tp: int, cache_bytes: Optional[int] = None) -> "PositionFiles":
        """Every DP rank's file of (pp, tp): as many as their data-parallel size says."""
        key = (kind, pp, tp)
        if key not in self._positions:
            paths = self._paths[kind].get((pp, tp))
            if not paths:
                raise CheckpointDataError(f"{self.where}: no offloaded optimizer state for pp={pp} tp={tp} "
                                          f"({SUBDIRS[kind]}/pp{pp:03d}_tp{tp:03d}_dp*.offload)")
            files = [self.file(paths[dp]) for dp in sorted(paths)]
            dp_size = files[0].metadata["dp_size"]
            if dp_size != len(files) or sorted(paths) != list(range(dp_size)) or \
                    any(f.metadata["dp_size"] != dp_size for f in files):
                raise CheckpointDataError(f"{self.where}: found {len(files)} offload files for pp={pp} tp={tp}, "
                                          f"their data-parallel size says {dp_size}: the checkpoint is incomplete")
            self._positions[key] = PositionFiles(files, self.where, cache_bytes)
        return self._positions[key]

    def file(self, path: str) -> StateFile:
        """``path`` opened (once) and its footer checked against the rest of the checkpoint."""
        if path not in self._open:
            self._open[path] = saved = StateFile(path)
            self._check(saved)
        return self._open[path]

    def _check(self, saved: StateFile) -> None:
        meta, footer = saved.metadata, saved.footer
        for key, kind in (("dp_size", int), ("model_chunks", int), ("ep_size", int), ("params", list),
                          ("geometry", dict)):
            if not isinstance(meta.get(key), kind):
                raise CheckpointDataError(f"{saved.path}: its footer's metadata has no {key}; the file was not used")
        for entry in meta["params"]:
            ok = (isinstance(entry, list) and len(entry) == 4 and isinstance(entry[0], str)
                  and all(isinstance(v, int) and not isinstance(v, bool) for v in entry[1:]))
            if not ok or entry[1] < 0 or entry[2] <= 0 or entry[3] < 0 or entry[3] + entry[2] > footer["numel"]:
                raise CheckpointDataError(f"{saved.path}: slice table entry {str(entry)[:80]} lies outside the "
                                          f"file's {footer['numel']} elements; the file was not used")
        if self.steps_done is None:
            self.steps_done = footer["steps_done"]
        elif footer["steps_done"] != self.steps_done:
            raise CheckpointDataError(f"{saved.path}: its offloaded state is at step {footer['steps_done']}, the "
                                      f"checkpoint's metadata says {self.steps_done}")

    # -- by region ----------------------------------------------------------------------------------
    def _geometries(self) -> Dict[torch.nn.Parameter, ParamGeometry]:
        if self._regions is None:
            self._param_geometry = param_geometries(self._run_chunks(), sharding_metadata())
            self._regions, self._shapes = self._index_saved_pieces()
        return self._param_geometry

    def _index_saved_pieces(self):
        """Every kind's positions (with another EP size a parameter may have moved between the dense
        and the experts' files), each piece by its global key and place."""
        where = [(kind, pp, tp) for kind in self.kinds() for pp, tp in self.positions(kind)]
        share = None if self.cache_bytes is None else self.cache_bytes // len(where)
        pieces: Dict[str, Dict[Tuple, _SavedPiece]] = {}
        shapes: Dict[str, Tuple[int, ...]] = {}
        for kind, pp, tp in where:
            position = self.position(kind, pp, tp, cache_bytes=share)
            for name, entry in position.geometry.items():
                geometry = ParamGeometry.from_json(entry)
                if geometry is None or name not in position.param_names():
                    raise CheckpointDataError(f"{position.files[0].path}: geometry of {name} is malformed: "
                                              f"{str(entry)[:80]}")
                if shapes.setdefault(geometry.key, geometry.global_shape) != geometry.global_shape:
                    raise CheckpointDataError(f"{self.where}: offload files disagree on the shape of "
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
            raise CheckpointDataError(f"{self.where}: {covered} of {inside} elements of {target.key} at "
                                      f"{list(box_offset)} are in its offload files; the checkpoint is incomplete")
        skip = first_row * row
        for out, region in zip(outs, rows):
            out.copy_(region.view(-1)[start - skip: end - skip])
        self._keep_warm(used)

    def _same_piece(self, param) -> Optional["_SavedPiece"]:
        """A saved piece that is ``param``'s very local tensor (its elements in the same flat order), if any."""
        target = self._geometries().get(param)
        if target is None:
            return None
        for piece in self._regions.get(target.key, []):
            saved = piece.geometry
            if (saved.global_shape, saved.global_offset, saved.local_shape) == \
                    (target.global_shape, target.global_offset, target.local_shape):
                return piece
        return None

    def _saved_shape(self, target: ParamGeometry) -> Tuple[int, ...]:
        saved = self._shapes.get(target.key)
        if saved is None:
            raise CheckpointDataError(f"{self.where}: no offloaded state for {target.key} (another model?)")
        if saved != target.global_shape and not (target.allow_shape_mismatch and len(saved) == len(target.global_shape)):
            raise CheckpointDataError(f"{self.where}: {target.key} was saved with shape {list(saved)}, this "
                                      f"model's is {list(target.global_shape)} (another model?)")
        return saved

    def _keep_warm(self, used: List[PositionFiles]) -> None:
        """Only the positions the last read used keep their cached subgroups (the next parameter
        is most likely theirs too): memory stays that of a few subgroups, however many files."""
        for position in self._warm:
            if all(position is not u for u in used):
                position.drop_cached()
        self._warm = used

    def close(self) -> None:
        for saved in self._open.values():
            saved.close()
        self._open.clear()
        self._positions.clear()
        self._warm = []

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


@dataclass
class _SavedPiece:
    geometry: ParamGeometry
    position: "PositionFiles"
    name: str  # the parameter's name in its files


def _copy_intersection(piece: _SavedPiece, lo, hi, box_offset, rows) -> None:
    """The saved rows spanning [lo, hi) are read whole (a parameter's local rows at most), then cut."""
    offset, shape = piece.geometry.global_offset, piece.geometry.local_shape
    row = volume(shape[1:])
    first, last = lo[0] - offset[0], hi[0] - offset[0]
    saved = [torch.empty((last - first) * row, dtype=torch.float32) for _ in rows]
    piece.position.read_by_name(piece.name, first * row, last * row, saved)
    source_cut = (slice(None), *(slice(x - o, y - o) for x, y, o in zip(lo[1:], hi[1:], offset[1:])))
    target_cut = tuple(slice(x - o, y - o) for x, y, o in zip(lo, hi, box_offset))
    for region, data in zip(rows, saved):
        region[target_cut].copy_(data.view(last - first, *shape[1:])[source_cut])
