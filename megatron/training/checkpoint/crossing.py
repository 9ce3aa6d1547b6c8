"""Load optimizer state saved by the other kind of optimizer: offloaded <-> megatron-core's own.

A checkpoint holds the Adam state either in ``iter_N/offload/`` files (the offload engine) or as
megatron-core's DistributedOptimizer ``dp_reshardable`` tensors (one flat tensor per DDP bucket and
state key, under ``optimizer.distributed.dp_group_idx_G.gbuf_idx_B.dtype_D.bucket_idx_K.KEY``).
Both hold the same numbers (fp32 master params, exp_avg, exp_avg_sq, the step count) over the
same DDP buckets, so either optimizer can resume from either form and continue bit for bit.

Memory: both directions move the state in pieces of at most ``max_bytes`` (--ckpt-convert-memory-mb),
beside what the target optimizer holds anyway. Offload -> plain reads each parameter's slice in
chunks straight into megatron-core's tensors, the offload files' reader caching no stored tensor
larger than its share (offloaded_state). Plain -> offload reads, for each subgroup the engine asks for, its elements
straight from the torch_dist files (torch_dist_ranges: no collective, so no rounds to agree on, and
never a whole saved item), one chunk at a time.

8-bit moments (the engine's fp8: one fp32 scale per 128 elements of each param) have no counterpart
there: megatron-core keeps fp32 moments, or with transformer-engine fp8 ones with one scale per
tensor. Offloaded -> plain dequantizes them to fp32 (its setter rounds them into its own format);
plain -> offloaded quantizes each subgroup's fp32 moments under its blocks: one rounding either way,
said in one line (``eight_bit_crossing``).
"""

from __future__ import annotations

from typing import List, Tuple

import torch
from megatron.core import parallel_state
from megatron.core.dist_checkpointing.mapping import ShardedObject

from megatron.training.checkpoint.offload_files import STATE_KEYS
from megatron.training.checkpoint.offloaded_state import SavedOffloadState
from megatron.training.checkpoint.torch_dist_ranges import FlatTensorRanges
from megatron.training.runtime.core_private import (main_param_and_optimizer_states,
                                                    set_main_param_and_optimizer_states)
from megatron.training.runtime.progress import print_rank0
from mlp_offload.checkpoint import CheckpointDataError, describe_formats, is_blockwise, values_fill

FP32 = 4


def _key_prefix(kind: str = "dense", optimizers: int = 1) -> str:
    """megatron-core's key for one of its distributed optimizers' state: indexed by the rank in the
    group its shards are replicas over (the model-parallel group; for the experts' optimizer the
    expert grid EP x ETP x PP), and, where it chains two (an MoE model at EP > 1), ``chained_<i>.``."""
    group = (parallel_state.get_model_parallel_group() if kind == "dense"
             else parallel_state.get_expert_tensor_model_pipeline_parallel_group())
    chained = "" if optimizers == 1 else f"chained_{0 if kind == 'dense' else 1}."
    return f"{chained}optimizer.distributed.dp_group_idx_{torch.distributed.get_rank(group)}"


def _dp_rank(kind: str) -> int:
    """This rank's place in the group ``kind``'s optimizer state is sharded over."""
    return (parallel_state.get_data_parallel_rank(with_context_parallel=True) if kind == "dense"
            else parallel_state.get_expert_data_parallel_rank())


# -- offloaded files -> megatron-core's DistributedOptimizer -------------------------------------
def fill_distributed_optimizer(dist_optimizers: List, saved: SavedOffloadState, offload_meta: dict,
                               max_bytes: int) -> None:
    """Put the offloaded state ``saved`` holds (saved at any DP, TP and PP) into megatron-core's
    optimizer(s), ``max_bytes`` at a time: half for a piece in flight (read straight into megatron-core's
    tensors, one state after the other), half for the files' readers (``saved.cache_bytes``)."""
    chunk = max(1, max_bytes // 2 // FP32)
    # (one line for all: a save stores every kind's moments alike)
    eight_bit_crossing(saved.saved_codecs("dense"), "dequantized for megatron-core's optimizer")
    for opt in dist_optimizers:
        # With EP > 1 megatron-core's second optimizer holds the experts: read from the experts' files.
        kind = "experts" if any(not getattr(p, "allreduce", True) for p, _ in _param_pieces(opt)) else "dense"
        for param, piece in _param_pieces(opt):
            if getattr(opt.config, "use_precision_aware_optimizer", False):
                _set_whole_piece(opt, saved, kind, param, piece)  # its setter scales whole tensors
                continue
            targets = main_param_and_optimizer_states(opt, param)
            for lo in range(0, piece.size, chunk):
                hi = min(piece.size, lo + chunk)
                saved.read(kind, param, piece.start + lo, piece.start + hi,
                           [targets[name].view(-1)[lo:hi] for name in STATE_KEYS])
        saved.drop_cached()
        _set_adam_step(opt, saved.steps_done)
        scalers = offload_meta["grad_scalers"]
        scaler = scalers[min(int(kind == "experts"), len(scalers) - 1)]  # each optimizer its own, as saved
        if opt.grad_scaler is not None and scaler:
            opt.grad_scaler.load_state_dict(scaler)


def eight_bit_crossing(codecs, what: str) -> None:
    """The one line a conversion of 8-bit moments gives (nothing for other formats)."""
    if is_blockwise(codecs):
        print_rank0(f"> the offloaded Adam moments are 8-bit ({describe_formats(codecs[1:])}: one fp32 scale per "
                    f"{max(c.block for c in codecs)} elements of each param; megatron-core keeps fp32 moments, or "
                    f"through transformer-engine fp8 ones with one scale per tensor): {what}, rounding them once")


def _param_pieces(opt):
    """(param, its range in this rank's shard) for every parameter of megatron-core's optimizer."""
    for gbuf_range_maps in opt.gbuf_ranges:
        for bucket_maps in gbuf_range_maps.values():
            for bucket_map in bucket_maps:
                for param, ranges in bucket_map["param_map"].items():
                    yield param, ranges["param"]


def _set_whole_piece(opt, saved: SavedOffloadState, kind: str, param, piece) -> None:
    outs = [torch.empty(piece.size, dtype=torch.float32) for _ in STATE_KEYS]
    saved.read(kind, param, piece.start, piece.end, outs)
    set_main_param_and_optimizer_states(opt, param, dict(zip(STATE_KEYS, outs)))


def _set_adam_step(opt, steps: int) -> None:
    for state in opt.optimizer.state.values():
        state["step"] = torch.tensor(float(steps), dtype=torch.float32)  # one tensor per param, not shared


# -- megatron-core's dp_reshardable tensors -> the offload engine --------------------------------
def saved_small_objects(facade, has_grad_scaler: bool) -> List[dict]:
    """Per shard of the offload facade, the small objects of megatron-core's matching optimizer (its
    param groups with the step, its grad scaler): a template read with the rest of the torch_dist
    files (checkpointing.load_checkpoint's one read), so the conversion makes no collective read of its own."""
    objects = []
    for shard in facade.shards:
        prefix = _key_prefix(shard.kind, len(facade.shards))
        replica = (0, 0, _dp_rank(shard.kind))  # as megatron-core's: one copy per model-parallel position
        wanted = {"optimizer": ShardedObject(f"{prefix}.optimizer", None, (1,), (0,), replica_id=replica)}
        if has_grad_scaler:
            wanted["grad_scaler"] = ShardedObject(f"{prefix}.grad_scaler", None, (1,), (0,), replica_id=replica)
        objects.append(wanted)
    return objects


class PlainShardSource:
    """This rank's part of a plain checkpoint's optimizer state, laid out as the offload engine's flat
    index space (the same DDP bucket shards), read a chunk at a time as the engine's load asks."""

    def __init__(self, layout, checkpoint_dir: str, max_bytes: int, kind: str = "dense", optimizers: int = 1):
        dp_rank, prefix = _dp_rank(kind), _key_prefix(kind, optimizers)
        self.chunk = max(1, max_bytes // FP32)
        # (flat start, flat end, key, its first element's place in the saved flat bucket tensor)
        self.pieces: List[Tuple[int, int, str, int]] = []
        piece_index = 0
        for gbuf_idx, gbuf_range_maps in enumerate(layout.gbuf_ranges):
            for dtype, bucket_maps in gbuf_range_maps.items():
                for bucket_idx, _ in enumerate(bucket_maps):
                    piece = layout.pieces[piece_index]
                    piece_index += 1
                    global_start = dp_rank * piece.numel
                    length = min(piece.numel, piece.buffer.buckets[bucket_idx].numel_unpadded - global_start)
                    if length > 0:  # the DP padding is not saved
                        key = f"{prefix}.gbuf_idx_{gbuf_idx}.dtype_{dtype}.bucket_idx_{bucket_idx}"
                        self.pieces.append((piece.flat_start, piece.flat_start + length, key, global_start))
        self._param_ranges = layout.flat_ranges(layout.param_flat_range)
        self.ranges = FlatTensorRanges(checkpoint_dir)

    def fill(self, sg, *outs) -> None:
        """The engine's load callback: subgroup [sg.start, sg.end) of this rank's shard."""
        for out in outs:
            out.zero_()  # padding between parameters: megatron-core saves none
        for a, b in self._param_ranges:
            c, hi = max(a, sg.start), min(b, sg.end)
            while c < hi:
                key, first, piece_end = self._saved_place(c)
                d = min(hi, c + self.chunk, piece_end)
                for name, out in zip(STATE_KEYS, outs):
                    self.ranges.read(f"{key}.{name}", first, first + d - c, out[c - sg.start: d - sg.start])
                c = d

    def _saved_place(self, flat: int) -> Tuple[str, int, int]:
        """(key, element) of flat position ``flat`` in the saved bucket tensors, and where its piece ends."""
        for start, end, key, global_start in self.pieces:
            if start <= flat < end:
                return key, global_start + flat - start, end
        raise CheckpointDataError(f"flat element {flat} of this rank's shard lies in no saved bucket")

    def close(self) -> None:
        self.ranges.close()


def _steps_and_scaler(loaded: dict) -> Tuple[int, dict]:
    groups = loaded["optimizer"].get("param_groups", [])
    steps = {int(g["step"]) for g in groups if "step" in g}
    if len(steps) != 1:
        raise CheckpointDataError(f"the checkpoint's optimizer param groups give steps {sorted(steps)}, not one")
    return steps.pop(), loaded.get("grad_scaler")


def load_into_engine(facade, checkpoint_dir: str, small_objects: List[dict], max_bytes: int) -> None:
    """Fill each of the offload facade's engines (and grad scalers) from a plain checkpoint's
    optimizer state: the dense one, and with EP > 1 the experts' one from megatron-core's second.
    ``small_objects``: what ``saved_small_objects`` asked for, as loaded."""
    eight_bit_crossing(facade.shards[0].engine.state_codecs, "quantized from megatron-core's saved moments")
    for shard, loaded in zip(facade.shards, small_objects):
        steps, scaler = _steps_and_scaler(loaded)
        source = PlainShardSource(shard.layout, checkpoint_dir, max_bytes, shard.kind, len(facade.shards))
        try:
            shard.engine.load_state(values_fill(shard.engine, source.fill), steps_done=steps)
        finally:
            source.close()
        if shard.grad_scaler is not None and scaler:
            shard.grad_scaler.load_state_dict(scaler)
