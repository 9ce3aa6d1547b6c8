"""Read a checkpoint's offloaded optimizer state by parameter name, whatever DP size wrote it.

The files of one (pp, tp) position, ``iter_N/offload/ppPPP_tpTTT_dp*.offload``, together hold each
parameter's fp32 master copy, exp_avg and exp_avg_sq; their footers say which slice of which
parameter (named ``<chunk>.<name>`` as ``named_parameters`` gives it) lies where. Used to reshard
across DP, to fill megatron-core's own optimizer from them, and by the conversion tool.
"""

from __future__ import annotations

import glob
import os
import re
from typing import Dict, List, Optional, Tuple

import torch

from mlp_offload.checkpoint import CheckpointDataError, RangeReader, merge_remainders, read_footer, stored_dtypes

STATE_KEYS = ("param", "exp_avg", "exp_avg_sq")  # the order of the tensors in an offload file


# The dense parameters' files, and the experts' (sharded over the expert grid and expert-data-parallel
# ranks: "tp" there is the rank's place in the EP x ETP grid of its stage, "dp" its expert-DP rank).
SUBDIRS = {"dense": "offload", "experts": "offload_experts"}


def offload_file_path(checkpoint_dir: str, pp: int, tp: int, dp: int, kind: str = "dense") -> str:
    return os.path.join(checkpoint_dir, SUBDIRS[kind], f"pp{pp:03d}_tp{tp:03d}_dp{dp:03d}.offload")


def has_offloaded_state(checkpoint_dir: str, kind: str = "dense") -> bool:
    return bool(glob.glob(os.path.join(checkpoint_dir, SUBDIRS[kind], "*.offload")))


_FILE_NAME = re.compile(r"pp(\d+)_tp(\d+)_dp(\d+)\.offload$")


def saved_model_parallel_sizes(checkpoint_dir: str, kind: str = "dense") -> Tuple[int, int]:
    """(PP, TP) sizes of the run that wrote the offload files, from their names (for the experts'
    files: PP and the size of the EP x ETP grid)."""
    found = [_FILE_NAME.search(f) for f in glob.glob(os.path.join(checkpoint_dir, SUBDIRS[kind], "*.offload"))]
    positions = {(int(m.group(1)), int(m.group(2))) for m in found if m}
    if not positions:
        raise CheckpointDataError(f"{checkpoint_dir}: no offloaded optimizer state (no {SUBDIRS[kind]}/*.offload "
                                  "files)")
    return max(p for p, _ in positions) + 1, max(t for _, t in positions) + 1


def _first_footer_metadata(checkpoint_dir: str, kind: str) -> dict:
    first = sorted(glob.glob(os.path.join(checkpoint_dir, SUBDIRS[kind], "*.offload")))[:1]
    return read_footer(first[0])["metadata"] if first else {}


def saved_model_chunks(checkpoint_dir: str, kind: str = "dense") -> int:
    """Model chunks per rank of the run that wrote the offload files: V with the interleaved
    pipeline, else 1 (files written before it was recorded had one)."""
    return _first_footer_metadata(checkpoint_dir, kind).get("model_chunks", 1)


def saved_expert_parallel_size(checkpoint_dir: str, kind: str = "dense") -> int:
    """The EP size of the run that wrote the files (1 before it was recorded)."""
    return _first_footer_metadata(checkpoint_dir, kind).get("ep_size", 1)


def same_model_parallel_layout(checkpoint_dir: str, pp: int, tp: int, chunks: int, kind: str = "dense",
                               ep: int = 1) -> bool:
    """Whether the files name this run's parameters (``<chunk>.<name>``) for the same global
    pieces: the same PP and TP sizes (for experts, the same EP x ETP grid) and chunks per rank."""
    if saved_expert_parallel_size(checkpoint_dir, kind) != ep:
        return False
    return (saved_model_parallel_sizes(checkpoint_dir, kind) == (pp, tp)
            and saved_model_chunks(checkpoint_dir, kind) == chunks)


class OffloadFileSet:
    """The offload files of one (pp, tp) position, opened for reads by (parameter, element range)."""

    def __init__(self, checkpoint_dir: str, pp: int, tp: int, cache_bytes: Optional[int] = None, kind: str = "dense"):
        pattern = offload_file_path(checkpoint_dir, pp, tp, 0, kind).replace("dp000", "dp*")
        self.files = sorted(glob.glob(pattern))
        if not self.files:
            raise CheckpointDataError(f"{checkpoint_dir}: no offloaded optimizer state for pp={pp} tp={tp} ({pattern})")
        footers = [read_footer(f) for f in self.files]
        self.dp_size = footers[0]["metadata"].get("dp_size")
        if self.dp_size != len(self.files) or any(f["metadata"].get("dp_size") != self.dp_size for f in footers):
            raise CheckpointDataError(f"{checkpoint_dir}: found {len(self.files)} offload files for pp={pp} tp={tp}, "
                                      f"their data-parallel size says {self.dp_size}: the checkpoint is incomplete")
        steps = {f["steps_done"] for f in footers}
        if len(steps) != 1:
            raise CheckpointDataError(f"{checkpoint_dir}: offload files disagree on the step count {sorted(steps)}")
        self.steps_done = steps.pop()
        self.where = checkpoint_dir
        # name -> ParamGeometry as JSON (files written before it was recorded have none)
        # (each file records its own parameters'; older ones recorded every parameter of the position)
        self.geometry: Dict[str, list] = {}
        for footer in footers:
            self.geometry.update(footer["metadata"].get("geometry") or {})
        share = None if cache_bytes is None else cache_bytes // len(self.files)  # what each file's reader may cache
        self._readers = [RangeReader(f, footer["subgroups"], stored_dtypes(footer), share)
                         for f, footer in zip(self.files, footers)]
        # param name -> [(offset in the param, length, offset in the file, reader)]
        self._held: Dict[str, List[Tuple[int, int, int, RangeReader]]] = {}
        for path, reader, footer in zip(self.files, self._readers, footers):
            for name, offset, length, flat in _param_slices(path, footer):
                self._held.setdefault(name, []).append((offset, length, flat, reader))

    def param_names(self):
        return self._held.keys()

    def read(self, name: str, start: int, end: int, outs, high: Optional[torch.Tensor] = None) -> None:
        """Elements [start, end) of parameter ``name`` into ``outs`` (one tensor per STATE_KEYS entry).
        ``high``: the model's bf16 values of these elements, which complete a master saved as 16-bit
        remainders into fp32 (without it such a file is refused)."""
        filled = 0
        for old_offset, length, flat, reader in self._held.get(name, []):
            x, y = max(start, old_offset), min(end, old_offset + length)
            if x < y:
                for k, out in enumerate(outs):
                    target = out[x - start: y - start]
                    if k == 0 and high is not None and reader.dtypes[0] == torch.int16 and out.dtype != torch.int16:
                        rem = torch.empty(y - x, dtype=torch.int16)
                        reader.read(k, flat + x - old_offset, flat + y - old_offset, rem)
                        piece_high = high[x - start: y - start].cpu()
                        if target.dtype == torch.float32 and target.is_contiguous():
                            merge_remainders(piece_high, rem, out=target)  # no fp32 temporary per piece
                        else:
                            target.copy_(merge_remainders(piece_high, rem))
                        continue
                    reader.read(k, flat + x - old_offset, flat + y - old_offset, target)
                filled += y - x
        if filled != end - start:
            raise CheckpointDataError(f"{self.where}: elements {start}..{end} of {name} are in no offload file "
                                      f"(another model or TP/PP layout?)")

    def drop_cached(self) -> None:
        """Forget the stored subgroups kept for the next read (bounds memory over many file sets)."""
        for reader in self._readers:
            reader.drop_cached()

    def close(self) -> None:
        for reader in self._readers:
            reader.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def _param_slices(path: str, footer: dict):
    """The footer's per-parameter slices, each checked to lie inside the file's elements."""
    slices = footer["metadata"].get("params")
    if not isinstance(slices, list):
        raise CheckpointDataError(f"{path}: no per-parameter slice table: it cannot be resharded")
    for entry in slices:
        ok = (isinstance(entry, list) and len(entry) == 4 and isinstance(entry[0], str)
              and all(isinstance(v, int) and not isinstance(v, bool) for v in entry[1:]))
        if not ok or entry[1] < 0 or entry[2] <= 0 or entry[3] < 0 or entry[3] + entry[2] > footer["numel"]:
            raise CheckpointDataError(f"{path}: slice table entry {str(entry)[:80]} lies outside the file's "
                                      f"{footer['numel']} elements; the file was not used")
    return slices


def param_names(model_chunks) -> Dict[torch.nn.Parameter, str]:
    """The names offload files use for the parameters of ``model_chunks`` (the DDP-wrapped list)."""
    return {param: f"{i}.{name}" for i, chunk in enumerate(model_chunks) for name, param in chunk.named_parameters()}
