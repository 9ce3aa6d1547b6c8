"""The offloaded optimizer state in a checkpoint: streamed beside dist_checkpointing's files.

Each rank writes ``iter_N/offload/ppPPP_tpTTT_dpDDD.offload``; its footer holds the data-parallel
size and per-parameter slices (name, offset in the parameter, length, offset in the file), so a
run with another data-parallel size (same TP and PP) finds its elements in the old ranks' files.
"""

from __future__ import annotations

import glob
import logging
import os
from typing import Optional

import torch

from megatron.training.checkpointing import rank_coordinates
from megatron.training.shard_layout import ShardLayout
from mlp_offload import OffloadedAdamW
from mlp_offload.checkpoint import (CheckpointDataError, RangeReader, load_engine_state, read_footer, save_engine_state,
                                    state_file_bytes)

log = logging.getLogger("mlp_offload")


class OffloadedStateFiles:
    """Save and load one rank's engine state, by element range (so subgroup size, tiers and budget
    may change between save and load) and, across data-parallel sizes, by parameter name."""

    def __init__(self, engine: OffloadedAdamW, layout: ShardLayout, model_chunks, dp_size: int):
        self.engine = engine
        self.layout = layout
        self.dp_size = dp_size
        # Stable names, so a checkpoint can be resharded onto another data-parallel size.
        self.param_names = {param: f"{i}.{name}" for i, chunk in enumerate(model_chunks)
                            for name, param in chunk.named_parameters()}

    def save(self, checkpoint_dir: str) -> int:
        """Stream this rank's state into ``checkpoint_dir/offload/`` (a file per rank); returns its bytes."""
        path = _state_path(checkpoint_dir)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        pieces = [[self.param_names[p], self.layout.param_slice[p], b - a, a]
                  for p, (a, b) in self.layout.param_flat_range.items()]
        return save_engine_state(self.engine, path, metadata={"dp_size": self.dp_size, "params": pieces})

    def nbytes(self) -> int:
        return state_file_bytes(self.engine.numel)

    def load(self, checkpoint_dir: str, expected_steps: Optional[int]) -> None:
        """Load this rank's state; ``expected_steps`` is the step count in the checkpoint's metadata."""
        path = _state_path(checkpoint_dir)
        same_dp = os.path.exists(path) and read_footer(path)["metadata"].get("dp_size") == self.dp_size
        if same_dp:
            load_engine_state(self.engine, path)
        else:
            self._load_resharded(checkpoint_dir)
        if expected_steps is not None and expected_steps != self.engine.steps_done:
            raise CheckpointDataError(f"offloaded state in {checkpoint_dir} is at step {self.engine.steps_done}, "
                                      f"the checkpoint's metadata says {expected_steps}")

    def _load_resharded(self, checkpoint_dir: str) -> None:
        """Fill this rank's shard from the files of another data-parallel size (same TP and PP):
        each parameter slice is read from whichever old ranks held it."""
        _, (p, t, _) = rank_coordinates()
        pattern = os.path.join(checkpoint_dir, "offload", f"pp{p:03d}_tp{t:03d}_dp*.offload")
        files = sorted(glob.glob(pattern))
        if not files:
            raise CheckpointDataError(f"{checkpoint_dir}: no offloaded optimizer state for pp={p} tp={t} ({pattern})")
        footers = [read_footer(f) for f in files]
        old_dp = footers[0]["metadata"].get("dp_size")
        if old_dp != len(files) or any(f["metadata"].get("dp_size") != old_dp for f in footers):
            raise CheckpointDataError(f"{checkpoint_dir}: found {len(files)} offload files for pp={p} tp={t}, "
                                      f"their data-parallel size says {old_dp}: the checkpoint is incomplete")
        steps = {f["steps_done"] for f in footers}
        if len(steps) != 1:
            raise CheckpointDataError(f"{checkpoint_dir}: offload files disagree on the step count {sorted(steps)}")
        readers = [RangeReader(f, footer["subgroups"]) for f, footer in zip(files, footers)]
        held = {}  # param name -> [(param offset, length, file flat offset, reader)]
        for path, reader, footer in zip(files, readers, footers):
            for name, offset, length, flat in _param_slices(path, footer):
                held.setdefault(name, []).append((offset, length, flat, reader))
        mine = sorted((a, b, self.layout.param_slice[param], self.param_names[param])
                      for param, (a, b) in self.layout.param_flat_range.items())

        def fill(sg, *outs):
            for out in outs:
                out.zero_()  # bucket padding holds no parameter
            for a, b, offset, name in mine:
                lo, hi = max(a, sg.start), min(b, sg.end)
                if lo >= hi:
                    continue
                want, want_end, filled = offset + lo - a, offset + hi - a, 0
                for old_offset, length, flat, reader in held.get(name, []):
                    x, y = max(want, old_offset), min(want_end, old_offset + length)
                    if x < y:
                        dst = lo - sg.start + (x - want)
                        for k, out in enumerate(outs):
                            reader.read(k, flat + x - old_offset, flat + y - old_offset, out[dst: dst + y - x])
                        filled += y - x
                if filled != want_end - want:
                    raise CheckpointDataError(f"{checkpoint_dir}: elements {want}..{want_end} of {name} are "
                                              f"in no offload file (another model or TP/PP layout?)")

        try:
            self.engine.load_state(fill, steps_done=steps.pop())
        finally:
            for reader in readers:
                reader.close()
        if torch.distributed.get_rank() == 0:
            log.info("offloaded state resharded from data-parallel size %d to %d", old_dp, self.dp_size)


def _state_path(checkpoint_dir: str) -> str:
    _, (p, t, d) = rank_coordinates()
    return os.path.join(checkpoint_dir, "offload", f"pp{p:03d}_tp{t:03d}_dp{d:03d}.offload")


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
