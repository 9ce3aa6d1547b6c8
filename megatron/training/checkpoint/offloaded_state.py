"""The offloaded optimizer state in a checkpoint: streamed beside dist_checkpointing's files, a file
per rank (saved_offload says what its footer records, so that a run with another DP, TP or PP
size finds its elements in the old ranks' files), and loaded back through offload_reader.
"""

from __future__ import annotations

import logging
import os
from typing import List, Literal

import torch

from megatron.training.checkpoint.format import sharding_metadata
from megatron.training.checkpoint.offload_reader import OffloadedStateReader
from megatron.training.checkpoint.param_geometry import param_geometries
from megatron.training.checkpoint.saved_offload import (SavedOffloadState, offload_file_path, param_names,
                                                        shard_coordinates)
from mlp_offload import OffloadedAdamW
from mlp_offload.checkpoint import fill_engine, state_file_bytes
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
        return state_file_bytes(self.engine.numel, self.engine.state_codecs)

    def load(self, saved: SavedOffloadState) -> None:
        """Load this rank's state from the checkpoint ``saved`` indexes (its step count checked there):
        its own file as saved, or each parameter slice from whichever old ranks held it."""
        reader = OffloadedStateReader(saved, self.model_chunks, self.kind)
        own = reader.whole_file(self.dp_size)
        if own is not None:
            fill_engine(self.engine, own)
            return
        mine = sorted((a, b, self.layout.param_slice[param], param)
                      for param, (a, b) in self.layout.param_flat_range.items())

        def fill(sg, *outs):
            for out in outs:
                out.zero_()  # bucket padding holds no parameter
            for a, b, offset, param in mine:
                lo, hi = max(a, sg.start), min(b, sg.end)
                if lo < hi:
                    reader.read(param, offset + lo - a, offset + hi - a,
                                [out[lo - sg.start: hi - sg.start] for out in outs])

        self.engine.load_state(fill, steps_done=saved.steps_done)
        if torch.distributed.get_rank() == 0:
            log.info("offloaded %sstate resharded from %s", "expert " if self.kind == "experts" else "",
                     reader.describe_change(self.dp_size))


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

