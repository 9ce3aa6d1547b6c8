"""The offloaded optimizer state in a checkpoint: streamed beside dist_checkpointing's files.

Each rank writes ``iter_N/offload/ppPPP_tpTTT_dpDDD.offload``; its footer holds the data-parallel
size, per-parameter slices (name, offset in the parameter, length, offset in the file) and each
parameter's place in its global tensor (param_geometry), so a run with another DP, TP or PP size
finds its elements in the old ranks' files (offload_state_source).
"""

from __future__ import annotations

import logging
import os
from typing import List, Literal, Optional

import torch

from megatron.training.checkpoint.format import sharding_metadata
from megatron.training.checkpoint.offload_files import offload_file_path, param_names, same_model_parallel_layout
from megatron.training.checkpoint.offload_state_source import OffloadedStateSource, shard_coordinates
from megatron.training.checkpoint.param_geometry import param_geometries
from mlp_offload import OffloadedAdamW
from mlp_offload.checkpoint import CheckpointDataError, load_engine_state, read_footer, state_file_bytes
from mlp_offload import BackgroundStateWrite, save_engine_state, start_background_save

log = logging.getLogger("mlp_offload")

ShardKind = Literal["dense", "experts"]  # which of megatron-core's distributed optimizers (offload_shard)


class OffloadedStateFiles:
    """Save and load one rank's engine state, by element range (so subgroup size, tiers and budget
    may change between save and load) and, across data-parallel sizes, by parameter name."""

    def __init__(self, engine: OffloadedAdamW, layout, model_chunks, dp_size: int,
                 kind: ShardKind = "dense"):
        self.kind = kind
        self.engine = engine
        self.layout = layout
        self.dp_size = dp_size
        self.model_chunks = model_chunks
        # Stable names, so a checkpoint can be resharded onto another data-parallel size.
        self.param_names = param_names(model_chunks)

    def save(self, checkpoint_dir: str) -> int:
        """Stream this rank's state into ``checkpoint_dir/offload/`` (a file per rank); returns its bytes."""
        return save_engine_state(self.engine, *self._file_and_metadata(checkpoint_dir))

    def start_save(self, checkpoint_dir: str) -> BackgroundStateWrite:
        """The same file, written by a thread from a snapshot taken now, once ``start()``ed."""
        return start_background_save(self.engine, *self._file_and_metadata(checkpoint_dir))

    def _file_and_metadata(self, checkpoint_dir: str):
        path = self._path(checkpoint_dir)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        pieces = [[self.param_names[p], self.layout.param_slice[p], b - a, a]
                  for p, (a, b) in self.layout.param_flat_range.items()]
        # Where each parameter lies in its global tensor: what a run at other TP/PP sizes needs.
        geometry = {self.param_names[p]: g.to_json()  # of this shard's parameters (dense or experts)
                    for p, g in param_geometries(self.model_chunks, sharding_metadata()).items()
                    if p in self.layout.param_flat_range}
        return path, {"dp_size": self.dp_size, "params": pieces, "geometry": geometry,
                      "model_chunks": len(self.model_chunks), "ep_size": shard_coordinates(self.kind)[2]}

    def _path(self, checkpoint_dir: str) -> str:
        _, (p, t, d), _ = shard_coordinates(self.kind)
        return offload_file_path(checkpoint_dir, p, t, d, self.kind)

    def nbytes(self) -> int:
        return state_file_bytes(self.engine.numel, self.engine.config.stored_dtypes)

    def load(self, checkpoint_dir: str, expected_steps: Optional[int]) -> None:
        """Load this rank's state; ``expected_steps`` is the step count in the checkpoint's metadata."""
        path = self._path(checkpoint_dir)
        (pp, tp, _), _, ep = shard_coordinates(self.kind)
        same_layout = (same_model_parallel_layout(checkpoint_dir, pp, tp, len(self.model_chunks), self.kind, ep)
                       and os.path.exists(path) and read_footer(path)["metadata"].get("dp_size") == self.dp_size)
        if same_layout:
            load_engine_state(self.engine, path)
        else:
            self._load_resharded(checkpoint_dir)
        if expected_steps is not None and expected_steps != self.engine.steps_done:
            raise CheckpointDataError(f"offloaded state in {checkpoint_dir} is at step {self.engine.steps_done}, "
                                      f"the checkpoint's metadata says {expected_steps}")

    def _load_resharded(self, checkpoint_dir: str) -> None:
        """Fill this rank's shard from files of another DP, TP or PP size: each parameter slice
        is read from whichever old ranks held it."""
        mine = sorted((a, b, self.layout.param_slice[param], param)
                      for param, (a, b) in self.layout.param_flat_range.items())
        with OffloadedStateSource(checkpoint_dir, self.model_chunks, kind=self.kind) as saved:
            def fill(sg, *outs):
                for out in outs:
                    out.zero_()  # bucket padding holds no parameter
                for a, b, offset, param in mine:
                    lo, hi = max(a, sg.start), min(b, sg.end)
                    if lo < hi:
                        saved.read(param, offset + lo - a, offset + hi - a,
                                   [out[lo - sg.start: hi - sg.start] for out in outs])

            self.engine.load_state(fill, steps_done=saved.steps_done)
            change = saved.describe_change(self.dp_size)
        if torch.distributed.get_rank() == 0:
            log.info("offloaded %sstate resharded from %s", "expert " if self.kind == "experts" else "", change)


class StateWrites:
    """Each shard's background write of one checkpoint, as one writer thread (async_save.WriterThread)."""

    def __init__(self, writes: List[BackgroundStateWrite]):
        self.writes = writes

    nbytes = property(lambda self: sum(w.nbytes for w in self.writes))
    write_s = property(lambda self: max(w.write_s for w in self.writes))
    paused_s = property(lambda self: sum(w.paused_s for w in self.writes))
    failure = property(lambda self: next((w.failure for w in self.writes if getattr(w, "failure", None)), None))

    def start(self) -> None:
        for w in self.writes:
            w.start()

    def done(self) -> bool:
        return all(w.done() for w in self.writes)

    def wait(self) -> None:
        for w in self.writes:
            w.wait()

    def cancel(self) -> None:
        for w in self.writes:
            w.cancel()

