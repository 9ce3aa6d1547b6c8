"""Checkpoint save/load through megatron-core ``dist_checkpointing``.

Layout (as Megatron-LM): ``SAVE/iter_0000005/`` (a dist_checkpointing directory) and
``SAVE/latest_checkpointed_iteration.txt``. One checkpoint holds the model's sharded state, the
optimizer's ``dp_reshardable`` sharded state, the LR scheduler, iteration, consumed samples and
every rank's RNG states, so a resumed run continues bit for bit.
"""

from __future__ import annotations

import os
import random
import shutil
from typing import Optional

import numpy as np
import torch
from megatron.core import dist_checkpointing, parallel_state, tensor_parallel
from megatron.core.dist_checkpointing.mapping import ShardedObject

from mlp_offload.faults import fault_point

TRACKER = "latest_checkpointed_iteration.txt"
OPTIMIZER_SHARDING = "dp_reshardable"


def _unwrap(chunk):
    """DDP -> Float16Module/GPTModel: DDP itself has no sharded_state_dict."""
    return chunk.module if hasattr(chunk, "module") else chunk


def _model_sharded_state_dict(model):
    if len(model) == 1:
        return _unwrap(model[0]).sharded_state_dict()
    return {f"model{i}": _unwrap(chunk).sharded_state_dict() for i, chunk in enumerate(model)}


def _rng_state():
    state = {
        "random": random.getstate(),
        "np_random": np.random.get_state(),
        "torch": torch.get_rng_state(),
        "tracker": tensor_parallel.get_cuda_rng_tracker().get_states(),
    }
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def _set_rng_state(state) -> None:
    random.setstate(state["random"])
    np.random.set_state(state["np_random"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])
    tensor_parallel.get_cuda_rng_tracker().set_states(state["tracker"])


def _parallel_layout():
    ps = parallel_state
    return {"tp": ps.get_tensor_model_parallel_world_size(), "pp": ps.get_pipeline_model_parallel_world_size(),
            "dp": ps.get_data_parallel_world_size()}


def _rng_sharded_object(state):
    """Every rank's RNG state, keyed by its (pp, tp, dp) coordinates."""
    ps = parallel_state
    shape = (ps.get_pipeline_model_parallel_world_size(), ps.get_tensor_model_parallel_world_size(),
             ps.get_data_parallel_world_size())
    offset = (ps.get_pipeline_model_parallel_rank(), ps.get_tensor_model_parallel_rank(),
              ps.get_data_parallel_rank())
    return ShardedObject("rng_state", state, shape, offset, replica_id=0)


def _prepare_fresh_optimizer_for_load(optimizer) -> None:
    """Give a never-stepped torch Adam(W) the 'step' entries its state_dict() asserts on.

    Without apex/transformer-engine, megatron-core's init_state_fn creates exp_avg/exp_avg_sq but
    no 'step', and DistributedOptimizer.state_dict() then fails while building the load template.
    The placeholder value is overwritten by load_state_dict from the checkpoint.
    """
    for opt in getattr(optimizer, "chained_optimizers", [optimizer]):
        inner = getattr(opt, "optimizer", None)
        init_state_fn = getattr(opt, "init_state_fn", None)
        if not isinstance(inner, (torch.optim.Adam, torch.optim.AdamW)) or init_state_fn is None:
            continue
        init_state_fn(inner, getattr(opt, "config", None))
        for state in inner.state.values():
            state.setdefault("step", torch.tensor(0.0))


def _restore_adam_steps(optimizer, loaded) -> None:
    """Put the checkpoint's Adam step back, one tensor per param, after a load.

    Without apex/TE two things go wrong in DistributedOptimizer's load path: the dp_reshardable
    param state carries 'step' as a LocalNonpersistentObject, so load copies the *template's*
    placeholder step over the restored one; and load_state_dict puts ONE step tensor in every
    param's state, which torch keeps aliased, so each step would bump it once per param.
    The true step is in the loaded param_groups.
    """
    chained = getattr(optimizer, "chained_optimizers", [optimizer])
    states = [loaded] if len(chained) == 1 else [loaded[k] for k in sorted(loaded)]
    for opt, opt_state in zip(chained, states):
        inner = getattr(opt, "optimizer", None)
        if not isinstance(inner, (torch.optim.Adam, torch.optim.AdamW)):
            continue
        groups = opt_state.get("optimizer", {}).get("param_groups", []) if isinstance(opt_state, dict) else []
        steps = {g["step"] for g in groups if "step" in g}
        if len(steps) != 1:
            continue
        step = float(steps.pop())
        for state in inner.state.values():
            if "step" in state:
                state["step"] = torch.tensor(step, dtype=torch.float32)


def _state_dict(model, optimizer, scheduler, iteration, consumed_samples, is_loading):
    model_sd = _model_sharded_state_dict(model)
    return {
        "model": model_sd,
        # metadata is megatron-core's current spelling of sharding_type='dp_reshardable'.
        "optimizer": optimizer.sharded_state_dict(
            model_sd, is_loading=is_loading, metadata={"distrib_optim_sharding_type": OPTIMIZER_SHARDING}),
        "opt_param_scheduler": scheduler.state_dict(),
        "iteration": iteration,
        "consumed_train_samples": consumed_samples,
        "rng_state": _rng_sharded_object(_rng_state()),
        "parallel_layout": _parallel_layout(),
    }


def checkpoint_dir(root: str, iteration: int) -> str:
    return os.path.join(root, f"iter_{iteration:07d}")


def save_checkpoint(root: str, iteration: int, model, optimizer, scheduler, consumed_samples: int) -> str:
    path = checkpoint_dir(root, iteration)
    rank = torch.distributed.get_rank()
    if os.path.isdir(root) and latest_iteration(root) == iteration:
        return path  # already complete: never rewrite the latest good checkpoint in place
    if rank == 0:
        if os.path.isdir(path):  # not the tracked one: left by a save that was interrupted
            print(f"> removing incomplete checkpoint {path} (an interrupted save)", flush=True)
            shutil.rmtree(path)
        os.makedirs(path, exist_ok=True)
    torch.distributed.barrier()
    state = _state_dict(model, optimizer, scheduler, iteration, consumed_samples, is_loading=False)
    dist_checkpointing.save(state, path)
    if hasattr(optimizer, "save_offloaded_state"):  # offloaded state streams beside it, per rank
        optimizer.save_offloaded_state(path)
    torch.distributed.barrier()
    fault_point("save-tracker")
    if rank == 0:  # written last: a crash mid-save leaves the previous checkpoint as the latest
        tmp = os.path.join(root, TRACKER + ".tmp")
        with open(tmp, "w") as f:
            f.write(str(iteration))
        os.replace(tmp, os.path.join(root, TRACKER))
    torch.distributed.barrier()
    return path


def latest_iteration(root: str) -> Optional[int]:
    tracker = os.path.join(root, TRACKER)
    if not os.path.exists(tracker):
        return None
    with open(tracker) as f:
        text = f.read().strip()
    try:
        return int(text)
    except ValueError:
        raise SystemExit(f"error: argument --load: {tracker} holds {text!r}, not an iteration number")


def load_checkpoint(root: str, model, optimizer, scheduler):
    """Restore everything; returns (iteration, consumed_samples), or (0, 0) when nothing is saved."""
    if not os.path.isdir(root):
        raise SystemExit(f"error: argument --load: {root} is not a directory")
    iteration = latest_iteration(root)
    if iteration is None:
        return 0, 0
    path = checkpoint_dir(root, iteration)
    _prepare_fresh_optimizer_for_load(optimizer)
    template = _state_dict(model, optimizer, scheduler, 0, 0, is_loading=True)
    saved_layout = dist_checkpointing.load_common_state_dict(path).get("parallel_layout")
    same_layout = saved_layout is None or saved_layout == template["parallel_layout"]
    if not same_layout:
        # Per-rank RNG states are keyed by (pp, tp, dp) position: another layout has other ranks.
        # Model, optimizer, scheduler and data position still load (resharded by megatron-core).
        del template["rng_state"]
        if torch.distributed.get_rank() == 0:
            print(f"> checkpoint layout {saved_layout} differs from this run's {template['parallel_layout']}: "
                  f"resharding; RNG states start from --seed", flush=True)
    state = dist_checkpointing.load(template, path)
    if len(model) == 1:
        _unwrap(model[0]).load_state_dict(state["model"])
    else:
        for i, chunk in enumerate(model):
            _unwrap(chunk).load_state_dict(state[f"model{i}"])
    optimizer.load_state_dict(state["optimizer"])
    if hasattr(optimizer, "load_offloaded_state"):
        optimizer.load_offloaded_state(path)
    _restore_adam_steps(optimizer, state["optimizer"])
    scheduler.load_state_dict(state["opt_param_scheduler"])
    if same_layout:
        _set_rng_state(state["rng_state"])
    torch.distributed.barrier()
    return state["iteration"], state["consumed_train_samples"]
