"""A checkpoint's offloaded optimizer state, read by this run's parameters whatever layout wrote it.

Same TP and PP and chunks per rank (any DP size): each parameter is found by name in this (pp, tp)
position's files. Other TP, PP or virtual pipeline size: by its global region (offload_geometry_reader). Both the offload engine and
megatron-core's own optimizer fill themselves through ``read(param, start, end, outs)``.
"""

from __future__ import annotations

from typing import Dict, Optional

import torch

from megatron.training.errors import UserError
from megatron.training.checkpoint.offload_files import (OffloadFileSet, has_offloaded_state, param_names,
                                                        same_model_parallel_layout,
                                                        saved_expert_parallel_size, saved_model_chunks,
                                                        saved_model_parallel_sizes)
from megatron.training.checkpoint.offload_geometry_reader import MissingGeometryError, OffloadedStateByGeometry
from megatron.training.checkpoint.param_geometry import ParamGeometry, param_geometries
from megatron.training.checkpoint.format import sharding_metadata
from megatron.training.checkpoint.rng import rank_coordinates
from mlp_offload.checkpoint import CheckpointDataError
from megatron.core import parallel_state


def shard_coordinates(kind: str = "dense"):
    """(pp, tp, dp) sizes and this rank's position, as offload files of ``kind`` are keyed, and the EP
    size (with another, experts may have moved between the dense and expert files). Dense: the model-parallel grid. Experts: "tp" is the place in the stage's EP x ETP grid and
    "dp" the expert-data-parallel rank, over which megatron-core shards the experts' optimizer."""
    ps = parallel_state
    ep, etp = ps.get_expert_model_parallel_world_size(), ps.get_expert_tensor_parallel_world_size()
    if kind == "dense":
        return (*rank_coordinates(), ep)
    shape = (ps.get_pipeline_model_parallel_world_size(), ep * etp, ps.get_expert_data_parallel_world_size())
    place = (ps.get_pipeline_model_parallel_rank(),
             ps.get_expert_model_parallel_rank() * etp + ps.get_expert_tensor_parallel_rank(),
             ps.get_expert_data_parallel_rank())
    return shape, place, ep


class _ByName:
    """This (pp, tp) position's files, saved at any DP size."""

    def __init__(self, checkpoint_dir: str, model_chunks, pp_rank: int, tp_rank: int, cache_bytes: Optional[int],
                 kind: str):
        self.files = OffloadFileSet(checkpoint_dir, pp_rank, tp_rank, cache_bytes, kind)
        self.names = param_names(model_chunks)
        self.steps_done, self.saved_dp_size = self.files.steps_done, self.files.dp_size

    def read(self, param, start: int, end: int, outs) -> None:
        # The model's loaded params complete masters saved as remainders (same elements: same layout).
        high = param.detach().view(-1)[start:end] if param.dtype == torch.bfloat16 else None
        self.files.read(self.names[param], start, end, outs, high)

    def close(self) -> None:
        self.files.close()


class _ByGeometry:
    """Every position's files, saved at another TP or PP size or another number of chunks per rank."""

    def __init__(self, checkpoint_dir: str, model_chunks, sharding_metadata: dict, saved_layout: str, now_layout: str,
                 cache_bytes: Optional[int]):
        try:
            self.state = OffloadedStateByGeometry(checkpoint_dir, cache_bytes)
        except MissingGeometryError:
            raise UserError(f"--load {checkpoint_dir}: its offloaded optimizer state was saved at {saved_layout} by "
                            f"a version that did not record parameter geometry, so it cannot be resharded to "
                            f"{now_layout}: resume at {saved_layout} (and save again to reshard later), "
                            f"or pass --no-load-optim") from None
        self.geometry: Dict[torch.nn.Parameter, ParamGeometry] = param_geometries(model_chunks, sharding_metadata)
        self.names = param_names(model_chunks)
        self.steps_done, self.saved_dp_size = self.state.steps_done, self.state.dp_size

    def read(self, param, start: int, end: int, outs) -> None:
        geometry = self.geometry.get(param)
        if geometry is None:
            self.close()
            raise CheckpointDataError(f"{self.state.where}: megatron-core gives no plain sharded tensor for "
                                      f"{self.names[param]}, so its offloaded state cannot be resharded across TP/PP")
        self.state.read(geometry, start, end, outs)

    def close(self) -> None:
        self.state.close()


def _layout(pp: int, tp: int, chunks: int, kind: str = "dense", ep: int = 1) -> str:
    grid = "TP" if kind == "dense" else "EPxETP"
    return f"{grid}={tp} PP={pp}" + (f" VPP={chunks}" if chunks > 1 else "") + (f" EP={ep}" if ep > 1 else "")


class OffloadedStateSource:
    """Opened for this rank: ``read``, ``steps_done``, ``saved_sizes`` (pp, tp), ``saved_dp_size``,
    ``saved_layout`` and ``layout`` (TP, PP and VPP as words). ``cache_bytes`` bounds the stored
    subgroups its file readers keep (None: two per file)."""

    def __init__(self, checkpoint_dir: str, model_chunks, cache_bytes: Optional[int] = None, kind: str = "dense"):
        (pp, tp, _), (p, t, _), ep = shard_coordinates(kind)
        # Experts saved at EP 1 are in the dense files (megatron-core keeps them there): described by those.
        saved_kind = kind if has_offloaded_state(checkpoint_dir, kind) else "dense"
        self.saved_sizes = saved_model_parallel_sizes(checkpoint_dir, saved_kind)
        self.saved_layout = _layout(*self.saved_sizes, saved_model_chunks(checkpoint_dir, saved_kind), saved_kind,
                                    saved_expert_parallel_size(checkpoint_dir, saved_kind))
        self.layout = _layout(pp, tp, len(model_chunks), kind, ep)
        self.same_model_parallel_layout = saved_kind == kind and same_model_parallel_layout(
            checkpoint_dir, pp, tp, len(model_chunks), kind, ep)
        if self.same_model_parallel_layout:
            self._impl = _ByName(checkpoint_dir, model_chunks, p, t, cache_bytes, kind)
        else:
            self._impl = _ByGeometry(checkpoint_dir, model_chunks, sharding_metadata(), self.saved_layout, self.layout,
                                     cache_bytes)
        self.steps_done, self.saved_dp_size = self._impl.steps_done, self._impl.saved_dp_size

    def read(self, param, start: int, end: int, outs) -> None:
        """Elements [start, end) of ``param`` (flat, in this rank's local tensor) into ``outs``,
        one float32 tensor per stored state (offload_files.STATE_KEYS)."""
        self._impl.read(param, start, end, outs)

    def describe_change(self, dp_size: int) -> str:
        if self.same_model_parallel_layout:
            return f"data-parallel size {self.saved_dp_size} to {dp_size}"
        return f"{self.saved_layout} DP={self.saved_dp_size} to {self.layout} DP={dp_size}"

    def close(self) -> None:
        self._impl.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
