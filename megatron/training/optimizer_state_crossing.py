"""Load optimizer state saved by the other kind of optimizer: offloaded <-> megatron-core's own.

A checkpoint holds the Adam state either in ``iter_N/offload/`` files (the offload engine) or as
megatron-core's DistributedOptimizer ``dp_reshardable`` tensors (one flat tensor per DDP bucket and
state key, under ``optimizer.distributed.dp_group_idx_G.gbuf_idx_B.dtype_D.bucket_idx_K.KEY``).
Both hold the same numbers (fp32 master params, exp_avg, exp_avg_sq, the step count) over the
same DDP buckets, so either optimizer can resume from either form and continue bit for bit.

Memory: offload -> plain reads slice by slice into megatron-core's own tensors; plain -> offload
reads this rank's shard of the three fp32 tensors into host memory at once (what the plain run held
on its device), then hands it to the engine subgroup by subgroup.
"""

from __future__ import annotations

from typing import Dict, List, Tuple

import torch
from megatron.core import dist_checkpointing, parallel_state
from megatron.core.dist_checkpointing.mapping import ShardedObject, ShardedTensor

from megatron.training.offload_files import STATE_KEYS
from megatron.training.offload_state_source import OffloadedStateSource
from mlp_offload.checkpoint import CheckpointDataError


def _dp_group_idx() -> int:
    """The index megatron-core names its optimizer keys by: the rank in the model-parallel group."""
    return torch.distributed.get_rank(parallel_state.get_model_parallel_group())


def _key_prefix() -> str:
    return f"optimizer.distributed.dp_group_idx_{_dp_group_idx()}"


# -- offloaded files -> megatron-core's DistributedOptimizer -------------------------------------
def fill_distributed_optimizer(dist_optimizers: List, model_chunks, checkpoint_dir: str, offload_meta: dict) -> None:
    """Put the offloaded state of ``checkpoint_dir`` (saved at any DP, TP and PP) into megatron-core's optimizer(s)."""
    with OffloadedStateSource(checkpoint_dir, model_chunks) as saved:
        for opt in dist_optimizers:
            for gbuf_range_maps in opt.gbuf_ranges:
                for bucket_maps in gbuf_range_maps.values():
                    for bucket_map in bucket_maps:
                        for param, ranges in bucket_map["param_map"].items():
                            piece = ranges["param"]
                            outs = [torch.empty(piece.size, dtype=torch.float32) for _ in STATE_KEYS]
                            saved.read(param, piece.start, piece.end, outs)
                            tensors = dict(zip(STATE_KEYS, outs), step=torch.tensor(float(saved.steps_done)))
                            opt._set_main_param_and_optimizer_states(param, tensors)
            _set_adam_step(opt, saved.steps_done)
            if opt.grad_scaler is not None and offload_meta.get("grad_scaler"):
                opt.grad_scaler.load_state_dict(offload_meta["grad_scaler"])


def _set_adam_step(opt, steps: int) -> None:
    for state in opt.optimizer.state.values():
        state["step"] = torch.tensor(float(steps), dtype=torch.float32)  # one tensor per param, not shared


# -- megatron-core's dp_reshardable tensors -> the offload engine --------------------------------
class DistributedOptimizerTemplate:
    """What to ask dist_checkpointing for to get this rank's part of a plain checkpoint's optimizer
    state, laid out as the offload engine's flat index space (the same DDP bucket shards)."""

    def __init__(self, layout, has_grad_scaler: bool):
        self.layout = layout
        dp_rank, prefix = parallel_state.get_data_parallel_rank(with_context_parallel=True), _key_prefix()
        self.tensors: Dict[str, torch.Tensor] = {k: torch.zeros(layout.numel, dtype=torch.float32) for k in STATE_KEYS}
        self.sharded: Dict[str, object] = {}
        piece_index = 0
        for gbuf_idx, gbuf_range_maps in enumerate(layout.gbuf_ranges):
            for dtype, bucket_maps in gbuf_range_maps.items():
                for bucket_idx, _ in enumerate(bucket_maps):
                    piece = layout.pieces[piece_index]
                    piece_index += 1
                    bucket = piece.buffer.buckets[bucket_idx]
                    unpadded = bucket.numel_unpadded
                    global_start = dp_rank * piece.numel
                    length = min(piece.numel, unpadded - global_start)  # the DP padding is not saved
                    if length <= 0:
                        continue
                    key = f"{prefix}.gbuf_idx_{gbuf_idx}.dtype_{dtype}.bucket_idx_{bucket_idx}"
                    for name in STATE_KEYS:
                        local = self.tensors[name][piece.flat_start: piece.flat_start + length]
                        self.sharded[f"{key}.{name}"] = _flat_shard(f"{key}.{name}", local, unpadded, global_start)
        self._param_ranges = layout.flat_ranges(layout.param_flat_range)
        replica = (0, 0, dp_rank)  # as megatron-core's: one copy per model-parallel position
        self.sharded["optimizer"] = ShardedObject(f"{prefix}.optimizer", None, (1,), (0,), replica_id=replica)
        if has_grad_scaler:
            self.sharded["grad_scaler"] = ShardedObject(f"{prefix}.grad_scaler", None, (1,), (0,), replica_id=replica)

    def steps_and_scaler(self, loaded: dict) -> Tuple[int, dict]:
        groups = loaded["optimizer"].get("param_groups", [])
        steps = {int(g["step"]) for g in groups if "step" in g}
        if len(steps) != 1:
            raise CheckpointDataError(f"the checkpoint's optimizer param groups give steps {sorted(steps)}, not one")
        return steps.pop(), loaded.get("grad_scaler")

    def fill(self, sg, *outs) -> None:
        """The engine's load callback: subgroup [sg.start, sg.end) of the loaded shard."""
        for name, out in zip(STATE_KEYS, outs):
            out.zero_()  # padding between parameters: megatron-core saves it uninitialized
            for a, b in self._param_ranges:
                lo, hi = max(a, sg.start), min(b, sg.end)
                if lo < hi:
                    out[lo - sg.start: hi - sg.start].copy_(self.tensors[name][lo:hi])


def _flat_shard(key: str, local: torch.Tensor, global_numel: int, global_start: int) -> ShardedTensor:
    return ShardedTensor(key, local, local.dtype, tuple(local.shape), (global_numel,), (global_start,),
                         axis_fragmentations=None, flattened_range=None, allow_shape_mismatch=False, replica_id=0)


def load_into_engine(facade, checkpoint_dir: str, has_grad_scaler: bool) -> None:
    """Fill the offload facade's engine (and grad scaler) from a plain checkpoint's optimizer state."""
    template = DistributedOptimizerTemplate(facade.layout, has_grad_scaler)
    loaded = dist_checkpointing.load(template.sharded, checkpoint_dir)
    steps, scaler = template.steps_and_scaler(loaded)
    facade.engine.load_state(template.fill, steps_done=steps)
    if facade.grad_scaler is not None and scaler:
        facade.grad_scaler.load_state_dict(scaler)
