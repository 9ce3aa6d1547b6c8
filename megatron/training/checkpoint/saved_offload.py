"""The index of a checkpoint's offloaded optimizer state, built once per load (by the load plan).

Each rank writes its shard as ``iter_N/offload/ppPPP_tpTTT_dpDDD.offload`` (the experts' shard:
``offload_experts/``, "tp" its place in the stage's EP x ETP grid, "dp" its expert-data-parallel
rank). A file's footer holds the data-parallel size, per-parameter slices (name, offset in the
parameter, length, offset in the file), each parameter's place in its global tensor
(param_geometry), the model chunks per rank and the EP size.

The index lists each directory once and opens a file only when first asked about it, once: its
footer is read and checked then (the step count against the checkpoint's, the slices against the
file's elements), and the same open file later serves its data (offload_reader). It answers which
layout wrote the state, this rank's own file, and a (pp, tp) position's files by parameter name.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from typing import Dict, List, Optional, Tuple

import torch
from megatron.core import parallel_state

from megatron.training.checkpoint.rng import rank_coordinates
from mlp_offload.checkpoint import CheckpointDataError, RangeReader, StateFile

STATE_KEYS = ("param", "exp_avg", "exp_avg_sq")  # the order of the tensors in an offload file
# The dense parameters' files, and the experts' (sharded over the expert grid and expert-data-parallel ranks).
SUBDIRS = {"dense": "offload", "experts": "offload_experts"}
_FILE_NAME = re.compile(r"^pp(\d+)_tp(\d+)_dp(\d+)\.offload$")


def offload_file_path(checkpoint_dir: str, pp: int, tp: int, dp: int, kind: str = "dense") -> str:
    return os.path.join(checkpoint_dir, SUBDIRS[kind], f"pp{pp:03d}_tp{tp:03d}_dp{dp:03d}.offload")


def shard_coordinates(kind: str = "dense"):
    """(pp, tp, dp) sizes and this rank's position, as offload files of ``kind`` are keyed, and the EP
    size. Dense: the model-parallel grid. Experts: "tp" is the place in the stage's EP x ETP grid
    and "dp" the expert-data-parallel rank, over which megatron-core shards the experts' optimizer."""
    ps = parallel_state
    ep, etp = ps.get_expert_model_parallel_world_size(), ps.get_expert_tensor_parallel_world_size()
    if kind == "dense":
        return (*rank_coordinates(), ep)
    shape = (ps.get_pipeline_model_parallel_world_size(), ep * etp, ps.get_expert_data_parallel_world_size())
    place = (ps.get_pipeline_model_parallel_rank(),
             ps.get_expert_model_parallel_rank() * etp + ps.get_expert_tensor_parallel_rank(),
             ps.get_expert_data_parallel_rank())
    return shape, place, ep


def param_names(model_chunks) -> Dict[torch.nn.Parameter, str]:
    """The names offload files use for the parameters of ``model_chunks`` (the DDP-wrapped list)."""
    return {param: f"{i}.{name}" for i, chunk in enumerate(model_chunks) for name, param in chunk.named_parameters()}


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


class SavedPosition:
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

    def read(self, name: str, start: int, end: int, outs, high: Optional[torch.Tensor] = None) -> None:
        """Elements [start, end) of parameter ``name`` into ``outs`` (one tensor per STATE_KEYS entry).
        ``high``: the model's bf16 values of these elements, which complete a master saved as 16-bit
        remainders into fp32 (without it such a file is refused)."""
        if self._readers is None:
            self._readers = [saved.ranges(self._share) for saved in self.files]
        filled = 0
        for old_offset, length, flat, i in self._held.get(name, []):
            x, y = max(start, old_offset), min(end, old_offset + length)
            if x >= y:
                continue
            reader, at = self._readers[i], flat - old_offset
            for k, out in enumerate(outs):
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

    def drop_cached(self) -> None:
        """Forget the stored subgroups kept for the next read (bounds memory over many positions)."""
        for reader in self._readers or []:
            reader.drop_cached()


class SavedOffloadState:
    """The index of ``checkpoint_dir``'s offload files. ``steps_done``: the step count the
    checkpoint's common state gives (None: the first file read sets it); every file must agree.
    Close it when the load is done: it holds the files it opened."""

    def __init__(self, checkpoint_dir: str, steps_done: Optional[int] = None):
        self.where = checkpoint_dir
        self.steps_done = steps_done
        # kind -> (pp, tp) -> dp -> path: each directory listed once
        self._paths = {kind: self._list(sub) for kind, sub in SUBDIRS.items()}
        self._open: Dict[str, StateFile] = {}
        self._positions: Dict[Tuple[str, int, int], SavedPosition] = {}

    def _list(self, subdir: str) -> Dict[Tuple[int, int], Dict[int, str]]:
        folder = os.path.join(self.where, subdir)
        try:
            names = os.listdir(folder)
        except FileNotFoundError:
            return {}
        grid: Dict[Tuple[int, int], Dict[int, str]] = {}
        for name in names:
            match = _FILE_NAME.match(name)
            if match:
                pp, tp, dp = (int(g) for g in match.groups())
                grid.setdefault((pp, tp), {})[dp] = os.path.join(folder, name)
        return grid

    # -- what was saved ---------------------------------------------------------------------------
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

    def position(self, kind: str, pp: int, tp: int, cache_bytes: Optional[int] = None) -> SavedPosition:
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
            self._positions[key] = SavedPosition(files, self.where, cache_bytes)
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

    def close(self) -> None:
        for saved in self._open.values():
            saved.close()
        self._open.clear()
        self._positions.clear()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
