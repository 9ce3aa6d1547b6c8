"""The model's part of a checkpoint: 'model', or 'model0', 'model1', ... for virtual pipeline chunks
(as upstream), each chunk's sharded state dict. Shared by the save and the load."""

from __future__ import annotations

from megatron.core.distributed import DistributedDataParallel


def unwrap(chunk):
    """DDP -> Float16Module/GPTModel: DDP itself has no sharded_state_dict."""
    return chunk.module if isinstance(chunk, DistributedDataParallel) else chunk


def model_state_keys(model) -> list:
    return ["model"] if len(model) == 1 else [f"model{i}" for i in range(len(model))]


def model_state(model, metadata) -> dict:
    """Each chunk's sharded state dict under its key."""
    return {key: unwrap(chunk).sharded_state_dict(metadata=metadata)
            for key, chunk in zip(model_state_keys(model), model)}
