"""The torch_dist state dict under Megatron-LM's keys: how dist_checkpointing writes and reads it,
the model's part and the RNG states (the save puts them in, the load's one collective read takes
them out).

- the model: 'model', or 'model0', 'model1', ... for virtual pipeline chunks (as upstream), each
  chunk's sharded state dict;
- the RNG states, as Megatron-LM keeps them: per (pp, tp) position a ShardedObject 'rng_state'
  holding every data-parallel rank's states (they differ: dropout);
- ``sharding_metadata``: what Megatron-LM passes to sharded_state_dict (key names, the optimizer form).
"""

from __future__ import annotations

import os
import random

import numpy as np
import torch
from megatron.core import parallel_state, tensor_parallel
from megatron.core.dist_checkpointing.mapping import ShardedObject
from megatron.core.dist_checkpointing.serialization import get_default_load_sharded_strategy
from megatron.core.dist_checkpointing.strategies.torch import TorchDistSaveShardedStrategy
from megatron.core.dist_checkpointing.strategies.fully_parallel import (FullyParallelLoadStrategyWrapper,
                                                                        FullyParallelSaveStrategyWrapper)
from megatron.core.distributed import DistributedDataParallel

from megatron.training.errors import UserError

OPTIMIZER_SHARDING = "dp_reshardable"


# -- how dist_checkpointing writes and reads ---------------------------------------------------------
def _data_parallel_group():
    return parallel_state.get_data_parallel_group(with_context_parallel=True)


def save_strategies(args, wrap=None) -> dict:
    """torch_dist's writer with ``writer_processes()`` processes per rank; --ckpt-fully-parallel-save:
    the data-parallel ranks share the writing of replicated shards. ``wrap``: a function wrapping torch_dist's
    strategy, under the fully parallel wrapper (its async save then sees the writers picked)."""
    strategy = TorchDistSaveShardedStrategy("torch_dist", 1, thread_count=writer_processes())
    if wrap is not None:
        strategy = wrap(strategy)
    if args.ckpt_fully_parallel_save and parallel_state.get_data_parallel_world_size() > 1:
        strategy = FullyParallelSaveStrategyWrapper(strategy, _data_parallel_group())
    return {"sharded_strategy": strategy}


def writer_processes() -> int:
    """How many processes write a rank's torch_dist files: megatron-core's default of 2 leaves a node's
    disk idle while each serialises its half; up to 8, within the node's cores shared by its ranks."""
    ranks_on_node = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    return max(2, min(8, (os.cpu_count() or 2) // max(1, ranks_on_node)))


def load_strategies(args, path: str) -> dict:
    """--ckpt-fully-parallel-load: each data-parallel rank reads a part and they exchange it."""
    if not args.ckpt_fully_parallel_load or parallel_state.get_data_parallel_world_size() == 1:
        return {}
    return {"sharded_strategy": FullyParallelLoadStrategyWrapper(get_default_load_sharded_strategy(path),
                                                                 _data_parallel_group())}


def sharding_metadata() -> dict:
    """What Megatron-LM passes to sharded_state_dict; it decides key names and the optimizer form."""
    return {"distrib_optim_sharding_type": OPTIMIZER_SHARDING, "singleton_local_shards": False,
            "chained_optim_avoid_prefix": True,
            "dp_cp_group": parallel_state.get_data_parallel_group(with_context_parallel=True)}


# -- the model -----------------------------------------------------------------------------------------
def unwrap(chunk):
    """DDP -> Float16Module/GPTModel: DDP itself has no sharded_state_dict."""
    return chunk.module if isinstance(chunk, DistributedDataParallel) else chunk


def model_state_keys(model) -> list:
    return ["model"] if len(model) == 1 else [f"model{i}" for i in range(len(model))]


def model_state(model, metadata) -> dict:
    """Each chunk's sharded state dict under its key (the save's state and the load's template)."""
    return {key: unwrap(chunk).sharded_state_dict(metadata=metadata)
            for key, chunk in zip(model_state_keys(model), model)}


def load_model(model, state: dict) -> None:
    for key, chunk in zip(model_state_keys(model), model):
        unwrap(chunk).load_state_dict(state[key])


# -- the RNG states ----------------------------------------------------------------------------------
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
    written once (replica_id: the DP rank). ``states`` None: the load's template."""
    (pp, tp, _), (p, t, d) = rank_coordinates()
    return ShardedObject("rng_state", states, (pp, tp), (p, t), replica_id=d)


def all_data_parallel_rng_states() -> list:
    """Every data-parallel rank's states (they differ: dropout), gathered so one rank saves them."""
    group = parallel_state.get_data_parallel_group()
    states = [None] * torch.distributed.get_world_size(group)
    torch.distributed.all_gather_object(states, rng_state(), group=group)
    return states


def load_rng(state: dict) -> None:
    """This rank's states from the loaded 'rng_state'."""
    saved = state["rng_state"]
    # saved without per-DP states (upstream without --data-parallel-random-init): one for all
    set_rng_state(saved[0] if len(saved) == 1 else saved[parallel_state.get_data_parallel_rank()])
