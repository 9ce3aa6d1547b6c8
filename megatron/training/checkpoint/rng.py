"""RNG states in a checkpoint, as Megatron-LM keeps them: per (pp, tp) position a ShardedObject
'rng_state' holding every data-parallel rank's states (they differ: dropout)."""

from __future__ import annotations

import random

import numpy as np
import torch
from megatron.core import parallel_state, tensor_parallel
from megatron.core.dist_checkpointing.mapping import ShardedObject

from megatron.training.errors import UserError


def rng_state() -> dict:
    """This rank's RNG states under Megatron-LM's names (no CUDA state on a CPU run)."""
    state = {
        "random_rng_state": random.getstate(),
        "np_rng_state": np.random.get_state(),
        "torch_rng_state": torch.get_rng_state(),
        "rng_tracker_states": tensor_parallel.get_cuda_rng_tracker().get_states(),
    }
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda_rng_state"] = torch.cuda.get_rng_state()
    return state


def set_rng_state(state: dict) -> None:
    _check_generators_match(state["rng_tracker_states"])
    random.setstate(state["random_rng_state"])
    np.random.set_state(state["np_rng_state"])
    torch.set_rng_state(state["torch_rng_state"])
    if "cuda_rng_state" in state and torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.set_rng_state(state["cuda_rng_state"])
    tensor_parallel.get_cuda_rng_tracker().set_states(state["rng_tracker_states"])


def _check_generators_match(saved_tracker_states: dict) -> None:
    """A GPU checkpoint's generator states (16-byte CUDA states) cannot seed a CPU run's generators
    (5056-byte states), nor the reverse: say so in one line instead of torch's size error."""
    current = tensor_parallel.get_cuda_rng_tracker().get_states()
    for name, saved in saved_tracker_states.items():
        if name in current and saved.numel() != current[name].numel():
            raise UserError(
                f"--load: the checkpoint's RNG state '{name}' is a {saved.numel()}-byte generator state, this "
                f"run's is {current[name].numel()} bytes (saved on another device type, GPU or CPU); add "
                "--no-load-rng to resume without the saved RNG states")


def rank_coordinates():
    """(pp, tp, dp) sizes and this rank's (pp, tp, dp) position: what per-rank state is keyed by."""
    ps = parallel_state
    shape = (ps.get_pipeline_model_parallel_world_size(), ps.get_tensor_model_parallel_world_size(),
             ps.get_data_parallel_world_size())
    offset = (ps.get_pipeline_model_parallel_rank(), ps.get_tensor_model_parallel_rank(),
              ps.get_data_parallel_rank())
    return shape, offset


def rng_sharded_object(states):
    """Upstream's 'rng_state': per (pp, tp) position, the list of its data-parallel ranks' states,
    written once (replica_id: the DP rank)."""
    (pp, tp, _), (p, t, d) = rank_coordinates()
    return ShardedObject("rng_state", states, (pp, tp), (p, t), replica_id=d)


def all_data_parallel_rng_states() -> list:
    """Every data-parallel rank's states (they differ: dropout), gathered so one rank saves them."""
    group = parallel_state.get_data_parallel_group()
    states = [None] * torch.distributed.get_world_size(group)
    torch.distributed.all_gather_object(states, rng_state(), group=group)
    return states


def this_rank_rng_state(saved) -> dict:
    if len(saved) == 1:
        return saved[0]  # saved without per-DP states (upstream without --data-parallel-random-init)
    return saved[parallel_state.get_data_parallel_rank()]
