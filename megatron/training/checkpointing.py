"""Checkpoint save/load through megatron-core ``dist_checkpointing``.

Layout (as Megatron-LM): ``SAVE/iter_0000005/`` (a dist_checkpointing directory) and
``SAVE/latest_checkpointed_iteration.txt``, plus the completeness proof of checkpoint_integrity. One checkpoint holds the model's sharded state, the
optimizer's ``dp_reshardable`` sharded state, the LR scheduler, iteration, consumed samples and
every rank's RNG states, so a resumed run continues bit for bit.
"""

from __future__ import annotations

import errno
import os
import random
import shutil
import time
from typing import Optional

import numpy as np
import torch
from megatron.core import dist_checkpointing, parallel_state, tensor_parallel
from megatron.core.dist_checkpointing.mapping import ShardedObject
from megatron.core.distributed import DistributedDataParallel
from megatron.core.optimizer import ChainedOptimizer, MegatronOptimizer

from megatron.training import checkpoint_integrity as integrity
from megatron.training.checkpoint_integrity import checkpoint_dir
from megatron.training.errors import UserError
from megatron.training.optimizer_interface import OffloadedOptimizerCheckpoint
from mlp_offload.checkpoint import CheckpointSaveError, human_bytes
from mlp_offload.faults import fault_point

OPTIMIZER_SHARDING = "dp_reshardable"
# What a file system says when the user must act (space, quota, permissions, a vanished or failing disk).
STORAGE_ERRNOS = {errno.ENOSPC, errno.EDQUOT, errno.EROFS, errno.EACCES, errno.EPERM, errno.ENOENT, errno.EIO}


def _unwrap(chunk):
    """DDP -> Float16Module/GPTModel: DDP itself has no sharded_state_dict."""
    return chunk.module if isinstance(chunk, DistributedDataParallel) else chunk


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


def rank_coordinates():
    """(pp, tp, dp) sizes and this rank's (pp, tp, dp) position: what per-rank state is keyed by."""
    ps = parallel_state
    shape = (ps.get_pipeline_model_parallel_world_size(), ps.get_tensor_model_parallel_world_size(),
             ps.get_data_parallel_world_size())
    offset = (ps.get_pipeline_model_parallel_rank(), ps.get_tensor_model_parallel_rank(),
              ps.get_data_parallel_rank())
    return shape, offset


def _parallel_layout():
    (pp, tp, dp), _ = rank_coordinates()
    return {"tp": tp, "pp": pp, "dp": dp}


def _rng_sharded_object(state):
    """Every rank's RNG state, keyed by its (pp, tp, dp) coordinates."""
    shape, offset = rank_coordinates()
    return ShardedObject("rng_state", state, shape, offset, replica_id=0)


def _megatron_optimizers(optimizer) -> list:
    """megatron-core's optimizers in ``optimizer``: a ChainedOptimizer's parts, or itself; none for
    the offload facade, whose state is no torch optimizer's."""
    if isinstance(optimizer, ChainedOptimizer):
        return optimizer.chained_optimizers
    return [optimizer] if isinstance(optimizer, MegatronOptimizer) else []


def _prepare_fresh_optimizer_for_load(optimizer) -> None:
    """Give a never-stepped torch Adam(W) the 'step' entries its state_dict() asserts on.

    Without apex/transformer-engine, megatron-core's init_state_fn creates exp_avg/exp_avg_sq but
    no 'step', and DistributedOptimizer.state_dict() then fails while building the load template.
    The placeholder value is overwritten by load_state_dict from the checkpoint.
    """
    for opt in _megatron_optimizers(optimizer):
        inner = opt.optimizer
        if not isinstance(inner, (torch.optim.Adam, torch.optim.AdamW)) or opt.init_state_fn is None:
            continue
        opt.init_state_fn(inner, opt.config)
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
    chained = _megatron_optimizers(optimizer)
    states = [loaded] if len(chained) == 1 else [loaded[k] for k in sorted(loaded)]
    for opt, opt_state in zip(chained, states):
        inner = opt.optimizer
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


def save_checkpoint(root: str, iteration: int, model, optimizer, scheduler, consumed_samples: int) -> str:
    """Save everything into ``root/iter_N`` and record it as the latest; see checkpoint_integrity for
    the order that makes a crash at any point leave the previous checkpoint as the one to resume."""
    path = checkpoint_dir(root, iteration)
    rank = torch.distributed.get_rank()
    started = time.perf_counter()
    decision = [None]
    if rank == 0:
        os.makedirs(root, exist_ok=True)
        needed, lines = integrity.clear_for_save(root, iteration)
        for line in lines:
            print(f"> {line}", flush=True)
        if needed:
            integrity.mark_in_progress(path)
        decision = [needed]
    torch.distributed.broadcast_object_list(decision, src=0)
    if not decision[0]:
        return path
    _check_free_space(root, path, iteration, model, optimizer)
    state = _state_dict(model, optimizer, scheduler, iteration, consumed_samples, is_loading=False)
    offload_bytes, offload_s, failure = 0, 0.0, None
    try:
        dist_checkpointing.save(state, path)
        if isinstance(optimizer, OffloadedOptimizerCheckpoint):  # streamed beside it, a file per rank
            t0 = time.perf_counter()
            offload_bytes = optimizer.save_offloaded_state(path)
            offload_s = time.perf_counter() - t0
    except CheckpointSaveError as err:
        failure = f"rank {rank}: {err}"
    except OSError as err:
        if err.errno not in STORAGE_ERRNOS:
            raise  # not the file system's doing: a bug, with its traceback
        failure = f"rank {rank}: {path}: {err.strerror or err}"
    _fail_together(failure, root, path)
    fault_point("save-complete")
    total = [None]
    if rank == 0:  # after every rank's files: the proof, then the tracker
        total = [integrity.mark_complete(path, iteration)]
    fault_point("save-tracker")
    if rank == 0:
        integrity.write_tracker(root, iteration)
    totals = torch.tensor([offload_bytes, offload_s], dtype=torch.float64, device=_device(model))
    torch.distributed.all_reduce(totals, op=torch.distributed.ReduceOp.MAX)  # the slowest rank's figures
    totals = totals.tolist()
    if rank == 0:
        seconds = time.perf_counter() - started
        offload = ""
        if totals[0] > 0:
            offload = (f"; offloaded optimizer state {human_bytes(totals[0])} per rank at "
                       f"{totals[0] / max(totals[1], 1e-9) / 1e9:.2f} GB/s")
        print(f"> saved checkpoint at iteration {iteration} to {root}: {human_bytes(total[0])} in {seconds:.1f} s"
              f"{offload}", flush=True)
    return path


def _check_free_space(root: str, path: str, iteration: int, model, optimizer) -> None:
    """Refuse before writing anything when the file system cannot hold the checkpoint."""
    needed = torch.tensor([_bytes_this_rank_saves(model, optimizer)], dtype=torch.float64, device=_device(model))
    torch.distributed.all_reduce(needed)  # on the model's device: NCCL reduces no CPU tensors
    verdict = [None]
    if torch.distributed.get_rank() == 0:
        st = os.statvfs(root)
        free = st.f_bavail * st.f_frsize
        if needed.item() > free:
            shutil.rmtree(path)  # holds only its in-progress marker
            verdict = [f"--save {root}: the checkpoint of iteration {iteration} needs about "
                       f"{human_bytes(needed.item())}, but only {human_bytes(free)} are free there; nothing was "
                       f"written and the previous checkpoints are untouched: free space or use another --save"]
    torch.distributed.broadcast_object_list(verdict, src=0)
    if verdict[0]:
        raise UserError(verdict[0])


def _device(model) -> torch.device:
    return next(model[0].parameters()).device


def _bytes_this_rank_saves(model, optimizer) -> int:
    """Model weights once per data-parallel replica group; optimizer state once per shard."""
    numel = sum(p.numel() for chunk in model for p in chunk.parameters())
    weights = sum(p.numel() * p.element_size() for chunk in model for p in chunk.parameters())
    first_replica = parallel_state.get_data_parallel_rank() == 0
    if isinstance(optimizer, OffloadedOptimizerCheckpoint):
        return weights * first_replica + optimizer.offloaded_state_bytes()
    # megatron-core's distributed optimizer: fp32 master, exp_avg and exp_avg_sq of this rank's shard
    return weights * first_replica + 12 * numel // parallel_state.get_data_parallel_world_size()


def _fail_together(failure: Optional[str], root: str, path: str) -> None:
    """Every rank learns whether any rank's part of the save failed; then all stop with its message."""
    failures = [None] * torch.distributed.get_world_size()
    torch.distributed.all_gather_object(failures, failure)
    first = next((f for f in failures if f), None)
    if first is None:
        return
    if torch.distributed.get_rank() == 0:
        shutil.rmtree(path, ignore_errors=True)  # still marked in progress: provably incomplete
    torch.distributed.barrier()
    raise UserError(f"--save {root}: {first}; the unfinished {path} was removed and the previous checkpoints are "
                    f"untouched")


def load_checkpoint(root: str, model, optimizer, scheduler):
    """Restore everything; returns (iteration, consumed_samples), or (0, 0) when nothing is saved."""
    if not os.path.isdir(root):
        raise UserError(f"--load {root}: not a directory")
    choice = [None]
    if torch.distributed.get_rank() == 0:
        try:
            iteration, notes = integrity.choose_checkpoint(root)
            choice = [(iteration, notes, None)]
        except ValueError as err:
            choice = [(None, [], str(err))]
    torch.distributed.broadcast_object_list(choice, src=0)
    iteration, notes, problem = choice[0]
    if problem:
        raise UserError(f"--load {root}: {problem}")
    if torch.distributed.get_rank() == 0:
        for note in notes:
            print(f"> {note}", flush=True)
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
    if isinstance(optimizer, OffloadedOptimizerCheckpoint):
        optimizer.load_offloaded_state(path)
    _restore_adam_steps(optimizer, state["optimizer"])
    scheduler.load_state_dict(state["opt_param_scheduler"])
    if same_layout:
        _set_rng_state(state["rng_state"])
    torch.distributed.barrier()
    return state["iteration"], state["consumed_train_samples"]
