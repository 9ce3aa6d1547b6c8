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
from megatron.core.dist_checkpointing.mapping import ShardedTensor, ShardedTensorFactory

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
    Of the parameters megatron-core shards through a factory, SwiGLU's fc1 (two halves) gets one;
    others get none."""
    found: Dict[torch.nn.Parameter, ParamGeometry] = {}
    for chunk in model_chunks:
        by_storage = {(p.data_ptr(), tuple(p.shape)): p for p in chunk.parameters()}
        module = getattr(chunk, "module", chunk)  # DDP has no sharded_state_dict; its module does
        for value in nested_values(module.sharded_state_dict(metadata=sharding_metadata)):
            data = getattr(value, "data", None)
            if not isinstance(data, torch.Tensor) or getattr(value, "flattened_range", None) is not None:
                continue
            param = by_storage.get((data.data_ptr(), tuple(data.shape)))
            if param is None:
                continue
            if isinstance(value, ShardedTensor):
                found[param] = _plain_geometry(value)
            elif isinstance(value, ShardedTensorFactory):
                geometry = _two_halves_geometry(value)
                if geometry is not None:
                    found[param] = geometry
    return found


def _plain_geometry(value: ShardedTensor) -> ParamGeometry:
    local = (1,) * value.prepend_axis_num + tuple(value.local_shape)
    return ParamGeometry(value.key, tuple(value.global_shape), tuple(value.global_offset), local,
                         bool(value.allow_shape_mismatch))


def _two_halves_geometry(factory: ShardedTensorFactory) -> Optional[ParamGeometry]:
    """A parameter stored as two halves along one axis, each TP-sharded on its own (SwiGLU's fc1:
    [gate; up]). Seen through a new axis of size 2 before that one, the global tensor is (..., 2, F, ...)
    and this rank's parameter is one box in it, so the halves reshard like any tensor. None if the
    factory builds anything else."""
    built = factory.build()
    if not (isinstance(built, (list, tuple)) and len(built) == 2 and all(isinstance(t, ShardedTensor) for t in built)):
        return None
    w, v = (_plain_geometry(t) for t in built)
    differs = [axis for axis in range(len(w.global_offset)) if w.global_offset[axis] != v.global_offset[axis]]
    same_key = w.key == v.key == factory.key
    if same_key and len(differs) == 1:  # one global tensor [w halves; v halves]
        axis = differs[0]
        rows = w.global_shape[axis] // 2
        if v.global_offset[axis] != w.global_offset[axis] + rows:
            return None
    elif (w.key, v.key) == (f"{factory.key}_w", f"{factory.key}_v") and not differs:  # two global tensors
        axis = len(w.global_shape) - len(factory.data.shape)  # the halves' axis: the first local one
        rows = w.global_shape[axis]
    else:
        return None
    prepended = len(w.local_shape) - factory.data.dim()
    if w.local_shape != v.local_shape or w.local_shape[axis] * 2 != factory.data.shape[axis - prepended] \
            or w.global_offset[axis] + w.local_shape[axis] > rows:
        return None
    split = lambda box, pair: box[:axis] + pair + box[axis + 1:]  # noqa: E731
    return ParamGeometry(factory.key, split(w.global_shape, (2, rows)), split(w.global_offset, (0, w.global_offset[axis])),
                         split(w.local_shape, (2, w.local_shape[axis])), w.allow_shape_mismatch)
