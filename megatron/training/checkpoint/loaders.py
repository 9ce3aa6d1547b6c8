"""One loader per kind of state a checkpoint holds, each doing what the load plan says for it.

The torch_dist files are read once, collectively, for every kind that lives there (the model, the
optimizer in its own form, the RNG states): each kind adds its part to the template
(``read_torch_dist``). Then each loader takes its part: the model's weights, the optimizer's state
(its own form from those files or the offload files, or converted from the other form), the
scheduler and the saved iteration and data position (from the common state), the RNG states.
"""

from __future__ import annotations

import time

import torch

from megatron.core import dist_checkpointing

from megatron.training.checkpoint.across_ranks import print_rank0, slowest_rank
from megatron.training.checkpoint.crossing import fill_distributed_optimizer, load_into_engine, saved_small_objects
from megatron.training.checkpoint.format import load_strategies, sharding_metadata
from megatron.training.checkpoint.load_plan import FROM_DISTRIBUTED, FROM_OFFLOADED, SAME_FORM, LoadPlan
from megatron.training.checkpoint.megatron_adam_state import (megatron_optimizers, prepare_fresh_optimizer_for_load,
                                                              restore_adam_steps)
from megatron.training.checkpoint.model_state import model_state, model_state_keys, unwrap
from megatron.training.checkpoint.rng import rng_sharded_object, set_rng_state, this_rank_rng_state
from megatron.training.runtime.progress import MemoryGrowth


def read_torch_dist(plan: LoadPlan, model, optimizer, args) -> dict:
    """One collective read of what the plan takes from the torch_dist files."""
    metadata = sharding_metadata()
    template = model_state(model, metadata)
    template.update(_optimizer_template(plan, optimizer, template, metadata))
    template.update(_rng_template(plan))
    return dist_checkpointing.load(template, plan.path, **load_strategies(args, plan.path))


# -- the model ------------------------------------------------------------------------------------
def load_model(model, state: dict) -> None:
    for key, chunk in zip(model_state_keys(model), model):
        unwrap(chunk).load_state_dict(state[key])


# -- the optimizer --------------------------------------------------------------------------------
def _optimizer_template(plan: LoadPlan, optimizer, model_template: dict, metadata) -> dict:
    """Its own form is read with the rest; from megatron-core's form, only the small objects (the
    step, the grad scaler): the conversion reads the large tensors by itself, in pieces."""
    if plan.optimizer == FROM_DISTRIBUTED:
        saved = plan.common.get("args")
        scaled = bool(getattr(saved, "fp16", False) or getattr(saved, "loss_scale", None))
        return {"plain_optimizer": saved_small_objects(optimizer, scaled and optimizer.grad_scaler is not None)}
    if plan.optimizer != SAME_FORM:
        return {}
    if not plan.run_offloaded:
        prepare_fresh_optimizer_for_load(optimizer)
    return {"optimizer": optimizer.sharded_state_dict(model_template, is_loading=True, metadata=metadata)}


def load_optimizer(plan: LoadPlan, optimizer, model, state: dict, args) -> None:
    if torch.cuda.is_available():
        # The model's weights were just copied in on the current stream; the offload engine reads and
        # writes them (the masters' high halves) on a stream of its own, which must see them landed.
        torch.cuda.synchronize()
    if plan.optimizer is None:
        optimizer.reload_model_params()  # the master copy starts from the loaded weights
    elif plan.optimizer == SAME_FORM:
        optimizer.load_state_dict(state["optimizer"])
        if plan.run_offloaded:
            optimizer.load_offloaded_state(plan.offload)
        else:
            restore_adam_steps(optimizer, state["optimizer"])
    elif plan.optimizer == FROM_OFFLOADED:
        prepare_fresh_optimizer_for_load(optimizer)  # the target's own state: allocated before the conversion
        offload_meta = plan.common["optimizer"]["offload_meta"]
        _convert("the offloaded form", plan.path, args, model, lambda max_bytes: fill_distributed_optimizer(
            megatron_optimizers(optimizer), model, plan.offload, offload_meta, max_bytes))
    else:  # FROM_DISTRIBUTED
        _convert("megatron-core's distributed optimizer form", plan.path, args, model,
                 lambda max_bytes: load_into_engine(optimizer, plan.path, state["plain_optimizer"], max_bytes))
        optimizer.gather_model_params()  # with remainders the split may have set this rank's model params


def _convert(source: str, path: str, args, model, conversion) -> None:
    """Run ``conversion(max_bytes)`` and say how long it took and how much memory it added at most."""
    started, growth = time.perf_counter(), MemoryGrowth()
    conversion(args.ckpt_convert_memory_mb << 20)
    grown = growth.peak_bytes()
    seconds, grown_mb = slowest_rank([time.perf_counter() - started, -1 if grown is None else grown / 2**20], model)
    memory = "" if grown_mb < 0 else f"; memory grew by at most {grown_mb:.0f} MB on any rank meanwhile"
    print_rank0(f"> optimizer state converted from {source} in {path} in {seconds:.1f} s, in pieces of at most "
                f"{args.ckpt_convert_memory_mb} MB (--ckpt-convert-memory-mb){memory}")


# -- the scheduler ----------------------------------------------------------------------------------
def load_scheduler(plan: LoadPlan, scheduler) -> None:
    if plan.scheduler:
        scheduler.load_state_dict(plan.common["opt_param_scheduler"])


# -- the RNG states ---------------------------------------------------------------------------------
def _rng_template(plan: LoadPlan) -> dict:
    return {"rng_state": rng_sharded_object(None)} if plan.rng else {}


def load_rng(plan: LoadPlan, state: dict) -> None:
    if plan.rng:
        set_rng_state(this_rank_rng_state(state["rng_state"]))


# -- where the run goes on --------------------------------------------------------------------------
def resume_position(plan: LoadPlan, args):
    """(iteration, consumed samples): where the loop and the data iterator start; the count of
    floating-point operations goes on from the saved one too (not with --finetune)."""
    if plan.resume:
        args.num_floating_point_operations_so_far = plan.common.get("num_floating_point_operations_so_far", 0)
    return plan.iteration, plan.consumed_samples
