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
The offload engines (``load_offloaded_state``, through the engine's face) and megatron-core's own
optimizer (crossing) both fill themselves through ``read``.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from typing import Dict, List, Optional, Sequence, Tuple

import torch

from megatron.training.checkpoint.offload_files import (FILE_NAME, SUBDIRS, ParamGeometry, param_geometries,
                                                        param_names, shard_coordinates, volume)
from megatron.training.checkpoint.state_dict import sharding_metadata
from mlp_offload.checkpoint import (BlockLayout, CheckpointDataError, Quantized, RangeReader, StateFile, fill_engine,
                                    is_blockwise, moments_change, quantize, stored_codecs)

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


class _PositionFiles:
    """The files of one (pp, tp) position, read by (parameter name, element range). Their readers
    are made on the first read; ``cache_bytes`` bounds what they keep (None: two subgroups a file)."""

    def __init__(self, files: List[StateFile], where: str, cache_bytes: Optional[int]):
        self.files, self.where = files, where
        self.dp_size = len(files)
        self.geometry: Dict[str, list] = {}  # name -> ParamGeometry as JSON; each file records its own
        # param name -> [(offset in the param, length, offset in the file, index of the file)]
        self._held: Dict[str, List[Tuple[int, int, int, int]]] = {}
        for i, saved in enumerate(files):
            self.geometry.update(saved.metadata["geometry"])
            for name, offset, length, flat in saved.metadata["params"]:
                self._held.setdefault(name, []).append((offset, length, flat, i))
        self._share = None if cache_bytes is None else cache_bytes // len(files)
        self._readers: Optional[List[RangeReader]] = None

    def param_names(self):
        return self._held.keys()

    def read_by_name(self, name: str, start: int, end: int, outs, high: Optional[torch.Tensor] = None,
                     keys: Sequence[int] = (0, 1, 2)) -> None:
        """Elements [start, end) of parameter ``name`` into ``outs`` (one tensor per STATE_KEYS entry,
        or per entry of ``keys``). ``high``: the model's bf16 values of these elements, which complete a
        master saved as 16-bit remainders into fp32 (without it such a file is refused)."""
        filled = 0
        for x, y, reader, at in self._holdings(name, start, end):
            for k, out in zip(keys, outs):
                target = out[x - start: y - start]
                master = reader.codecs[0]
                if k == 0 and high is not None and master.needs_high and out.dtype != master.storage_dtype:
                    rem = master.empty(y - x)
                    reader.read(k, at + x, at + y, rem)
                    piece_high = high[x - start: y - start].cpu()
                    if target.dtype == torch.float32 and target.is_contiguous():
                        master.unpack(rem, out=target, high=piece_high)  # no fp32 temporary per piece
                    else:
                        target.copy_(master.unpack(rem, high=piece_high))
                    continue
                reader.read(k, at + x, at + y, target)
            filled += y - x
        if filled != end - start:
            raise CheckpointDataError(f"{self.where}: elements {start}..{end} of {name} are in no offload file "
                                      f"(another model or TP/PP layout?)")

    def _holdings(self, name: str, start: int, end: int):
        """(x, y, reader, at): elements [x, y) of [start, end) of parameter ``name`` are in ``reader``'s
        file from its element ``at + x`` on."""
        if self._readers is None:
            self._readers = [saved.ranges(self._share) for saved in self.files]
        for old_offset, length, flat, i in self._held.get(name, []):
            x, y = max(start, old_offset), min(end, old_offset + length)
            if x < y:
                yield x, y, self._readers[i], flat - old_offset

    def read_moments_by_name(self, name: str, start: int, end: int, targets: Sequence[Quantized],
                             layout: BlockLayout) -> None:
        """8-bit moments (exp_avg, exp_avg_sq) of elements [start, end) of parameter ``name`` into
        ``targets``, whose blocks ``layout`` gives (this run's: multiples of its block in the
        parameter, and the range's ends). A stretch whose both ends are block boundaries in the saved
        file and in ``layout`` moves as its codes and scales, unchanged; the blocks around any other
        cut are dequantized and quantized again under ``layout`` (one more rounding, there only)."""
        block, moved = layout.block, []

        def ours(pos: int) -> bool:
            return pos in (start, end) or pos % block == 0

        for x, y, reader, at in self._holdings(name, start, end):
            if any(c.block != block or getattr(c, "fmt", None) != t.fmt for c, t in zip(reader.codecs[1:], targets)):
                continue  # saved in other formats or blocks: as values, below

            def both(pos: int) -> bool:
                return ours(pos) and reader.is_block_boundary(at + pos)

            a = x if both(x) else min(y, -(-x // block) * block)
            b = y if both(y) else y // block * block
            if a >= b or not (both(a) and both(b)):
                continue
            first, last = layout.block_span(a - start, b - start)
            for k, target in enumerate(targets, 1):
                reader.read_quantized(k, at + a, at + b, Quantized(
                    target.codes[a - start: b - start], target.scales[first:last], target.fmt))
            moved.append((a, b))
        pos = start
        for a, b in sorted(moved) + [(end, end)]:
            if pos < a:  # whole blocks of ``layout`` between moved stretches: through their values
                values = [torch.empty(a - pos, dtype=torch.float32) for _ in targets]
                self.read_by_name(name, pos, a, values, keys=(1, 2))
                first, last = layout.block_span(pos - start, a - start)
                for value, target in zip(values, targets):
                    quantize(value, layout.span(first, last), target.fmt, out=Quantized(
                        target.codes[pos - start: a - start], target.scales[first:last], target.fmt))
            pos = b

    def drop_cached(self) -> None:
        """Forget the stored subgroups kept for the next read (bounds memory over many positions)."""
        for reader in self._readers or []:
            reader.drop_cached()


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
        self._positions: Dict[Tuple[str, int, int], _PositionFiles] = {}
        self._run: Dict[str, _RunShard] = {}  # kind -> how this run's parameters of that kind are read
        self._names: Optional[Dict[torch.nn.Parameter, str]] = None
        # by region, made on the first such read: this run's params' places, the saved pieces and global shapes
        self._param_geometry: Dict[torch.nn.Parameter, ParamGeometry] = {}
        self._regions: Optional[Dict[str, List[_SavedPiece]]] = None
        self._shapes: Dict[str, Tuple[int, ...]] = {}
        self._warm: List[_PositionFiles] = []

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
        stretches keep their codes and scales (``_PositionFiles.read_moments_by_name``); by region
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

    def position(self, kind: str, pp: int, tp: int, cache_bytes: Optional[int] = None) -> "_PositionFiles":
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
            self._positions[key] = _PositionFiles(files, self.where, cache_bytes)
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

    def _keep_warm(self, used: List[_PositionFiles]) -> None:
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
    position: "_PositionFiles"
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


# -- the offload engines, from a checkpoint -----------------------------------------------------------
def load_offloaded_state(shards, saved: SavedOffloadState, offload_meta: dict, model) -> None:
    """Each of the offload facade's shards (``kind``, ``engine``, ``layout``, ``dp_group``,
    ``grad_scaler``) from ``saved``: its grad scaler from the common state's ``offload_meta``, its
    engine from its own file as saved or each parameter slice from whichever old ranks held it."""
    # A checkpoint saved with one shard (no experts' optimizer, or EP 1) has one scaler: the dense shard's.
    for shard, scaler in zip(shards, offload_meta["grad_scalers"]):
        if shard.grad_scaler is not None and scaler:
            shard.grad_scaler.load_state_dict(scaler)
    for shard in shards:
        _load_engine(shard, saved)
    gather_model_params(shards, model)


def _load_engine(shard, saved: SavedOffloadState) -> None:
    dp_size = shard.dp_group.size()
    own = saved.whole_file(shard.kind, dp_size)
    first = torch.distributed.get_rank() == 0
    notice = moments_change(saved.saved_codecs(shard.kind), shard.engine.state_codecs)
    if own is not None:
        fill_engine(shard.engine, own, notice=False)
        if notice and first:
            log.warning("offloaded %sstate: %s", "expert " if shard.kind == "experts" else "", notice)
        return
    layout = shard.layout
    mine = sorted((a, b, layout.param_slice[param], param) for param, (a, b) in layout.param_flat_range.items())

    def fill(sg, *outs):
        for out in outs:
            out.zero_()  # bucket padding holds no parameter
        for a, b, offset, param in mine:
            lo, hi = max(a, sg.start), min(b, sg.end)
            if lo < hi:
                saved.read(shard.kind, param, offset + lo - a, offset + hi - a,
                           [out[lo - sg.start: hi - sg.start] for out in outs])

    eight_bit = is_blockwise(shard.engine.state_codecs)
    shard.engine.load_state(_eight_bit_fill(shard, saved, mine) if eight_bit else fill, steps_done=saved.steps_done)
    if first:
        log.info("offloaded %sstate resharded from %s%s", "expert " if shard.kind == "experts" else "",
                 saved.describe_change(shard.kind, dp_size), f" ({notice})" if notice else "")


def _eight_bit_fill(shard, saved: SavedOffloadState, mine):
    """The engine's load callback for 8-bit moments: each parameter's piece of a subgroup through
    ``saved.read_eight_bit``, into the subgroup's codes and scales under its own blocks."""
    engine = shard.engine
    codecs, params, block = engine.state_codecs, engine.blocks.params, engine.blocks.block

    def fill(sg, master, *moments):
        for out in (master, *moments):
            out.zero_()  # bucket padding holds no parameter (codes and scales of zero: zeros)
        layout = params.layout(sg.start, sg.end, block)
        targets = [codec.split(raw, sg.numel, sg.blocks) for raw, codec in zip(moments, codecs[1:])]
        for a, b, offset, param in mine:
            lo, hi = max(a, sg.start), min(b, sg.end)
            if lo < hi:
                first, last = layout.block_span(lo - sg.start, hi - sg.start)
                pieces = [Quantized(t.codes[lo - sg.start: hi - sg.start], t.scales[first:last], t.fmt)
                          for t in targets]
                saved.read_eight_bit(shard.kind, param, offset + lo - a, offset + hi - a,
                                     master[lo - sg.start: hi - sg.start], pieces, layout.span(first, last))

    return fill


def gather_model_params(shards, model) -> None:
    """After a load into the engines: where masters are stored as remainders, a load from an fp32
    master set this rank's shard of the model's params from it (half-away rounding); every rank
    gets them."""
    if any(shard.engine.config.param_remainders for shard in shards):
        for chunk in model:
            chunk.start_param_sync(force_sync=True)
