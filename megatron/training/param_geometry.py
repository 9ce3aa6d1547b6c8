"""Where each local parameter lies in its global tensor, as megatron-core's checkpoints place it.

A parameter's ShardedTensor (from the model chunk's ``sharded_state_dict()``) names the global
tensor (its key is layout-free: a pipeline stage's layer 0 is global layer ``offset[0]``), its
global shape and this rank's offset in it. Recorded beside the offloaded optimizer state, it lets a
run with other TP/PP sizes find each of its elements in the old ranks' files.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, Optional, Tuple

import torch
from megatron.core.dist_checkpointing.dict_utils import nested_values
from megatron.core.dist_checkpointing.mapping import ShardedTensor

Box = Tuple[int, ...]


@dataclass(frozen=True)
class ParamGeometry:
    key: str  # the global tensor's name in a checkpoint
    global_shape: Box
    global_offset: Box  # of this rank's local tensor, one entry per global axis
    local_shape: Box  # the local tensor with megatron-core's prepended axes (size 1) in front
    allow_shape_mismatch: bool  # padded (the vocabulary): the global shape may differ between layouts

    def to_json(self) -> list:
        return [self.key, list(self.global_shape), list(self.global_offset), list(self.local_shape),
                self.allow_shape_mismatch]

    @classmethod
    def from_json(cls, entry) -> Optional["ParamGeometry"]:
        """None for an entry that does not have the shape of one (the caller names the file)."""
        try:
            key, shape, offset, local, mismatch = entry
            geometry = cls(str(key), tuple(map(int, shape)), tuple(map(int, offset)), tuple(map(int, local)),
                           bool(mismatch))
        except (TypeError, ValueError):
            return None
        sound = (len(geometry.global_shape) == len(geometry.global_offset) == len(geometry.local_shape)
                 and all(0 <= o and 0 < n and o + n <= g for o, n, g in
                         zip(geometry.global_offset, geometry.local_shape, geometry.global_shape)))
        return geometry if sound else None

    @property
    def numel(self) -> int:
        return volume(self.local_shape)


def volume(shape) -> int:
    n = 1
    for s in shape:
        n *= s
    return n


def param_geometries(model_chunks, sharding_metadata: dict) -> Dict[torch.nn.Parameter, ParamGeometry]:
    """Each parameter's geometry, matched to its ShardedTensor by storage (the tensor *is* the param).
    Parameters megatron-core shards through a factory (e.g. SwiGLU's fc1) get none."""
    found: Dict[torch.nn.Parameter, ParamGeometry] = {}
    for chunk in model_chunks:
        by_storage = {(p.data_ptr(), tuple(p.shape)): p for p in chunk.parameters()}
        module = getattr(chunk, "module", chunk)  # DDP has no sharded_state_dict; its module does
        for value in nested_values(module.sharded_state_dict(metadata=sharding_metadata)):
            if not isinstance(value, ShardedTensor) or value.flattened_range is not None:
                continue
            param = by_storage.get((value.data.data_ptr(), tuple(value.data.shape)))
            if param is not None:
                local = (1,) * value.prepend_axis_num + tuple(value.local_shape)
                found[param] = ParamGeometry(value.key, tuple(value.global_shape), tuple(value.global_offset),
                                             local, bool(value.allow_shape_mismatch))
    return found
