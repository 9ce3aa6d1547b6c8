"""The pretraining loop: model, optimizer, schedule, logging, evaluation, checkpoints.

Built from megatron-core pieces: GPTModel (via the caller's model provider), its
DistributedDataParallel, ``get_megatron_optimizer`` (or the offload optimizer, see
``build_optimizer``), ``OptimizerParamScheduler`` and ``get_forward_backward_func``.
"""

from __future__ import annotations

import math
import os
import time
from dataclasses import dataclass
from typing import Callable, List, Optional, Tuple

import torch
from megatron.core import parallel_state
from megatron.core.distributed import DistributedDataParallel, finalize_model_grads
from megatron.core.optimizer import get_megatron_optimizer
from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler
from megatron.core.transformer.module import Float16Module

from megatron.training.data import batch_schedule
from megatron.training.checkpoint import checkpointing
from megatron.training.offload import job_facts
from megatron.training.metrics import moe as moe_metrics
from megatron.training.checkpoint.async_save import BackgroundSaves
from megatron.training.args.arguments import parse_args
from megatron.training.checkpoint.integrity import finish_retiring
from megatron.training.data.datasets import build_tokenizer, micro_batches, padded_vocab_size
from megatron.training.errors import reported_once
from megatron.training.model.flops import GptShape, flops_per_iteration
from megatron.training.model import kernels as optional_kernels
from megatron.training.model.ddp_staging import stage_params_on_host
from megatron.training.model.host_params import ddp_with_params_in_host_memory
from megatron.training.offload.options import grads_in_host_memory, layer_major_flags, params_in_host_memory
from megatron.training.model.layer_major import check_step_schedule, step_schedule
from megatron.training.model.sdpa_attention import admitted_cuda_kernels
from megatron.training.runtime import determinism, fault_injection
from megatron.training.runtime.core_private import reset_grad_accumulation
from mlp_offload import build_cpu_kernel_in_background
from megatron.training.runtime.iteration_hooks import IterationHooks
from megatron.training.data.lr_schedule import build_param_scheduler
from megatron.training.initialize import initialize
from megatron.training.model.configs import ddp_config_of, optimizer_config, transformer_config
from megatron.training.metrics.records import IterationRecord, ValidationRecord
from megatron.training.metrics.run_metrics import build_metrics
from megatron.training.model.sizes import counted_params, params_l2_norm
from megatron.training.runtime.optimizer_interface import HoldsResources, ReportsIteration, TrainingOptimizer
from megatron.training.runtime.progress import StartUpPhases
from megatron.training.runtime.signals import StopCheck
from megatron.training.metrics.timers import LoopTimers
from megatron.training.model.virtual_pipeline import chunk_roles, per_chunk
from mlp_offload import fault_point


# ----------------------------------------------------------------------------- model and optimizer

def build_model(args, config, model_provider: Callable, device) -> List[torch.nn.Module]:
    """This rank's model chunks (one, or V with the interleaved pipeline), each cast to 16 bit and
    wrapped in DDP. The provider is given ``vp_stage`` only with the interleaved pipeline, as upstream."""
    ddp_config = ddp_config_of(args)
    roles = chunk_roles(parallel_state.get_pipeline_model_parallel_rank(),
                        parallel_state.get_pipeline_model_parallel_world_size(),
                        args.virtual_pipeline_model_parallel_size)
    chunks = []
    for vp_stage, pre, post in roles:  # all built first, in chunk order, as upstream draws their init
        stage = {} if vp_stage is None else {"vp_stage": vp_stage}
        chunks.append(model_provider(args, config, pre_process=pre, post_process=post, **stage).to(device))
    if args.bf16 or args.fp16:
        chunks = [Float16Module(config, chunk) for chunk in chunks]
    def ddp(chunk, i: int):  # as upstream: chunks after the first are one bucket each (their reduction overlaps compute)
        return DistributedDataParallel(config=config, ddp_config=ddp_config, module=chunk, disable_bucketing=i > 0)
    if params_in_host_memory(args):  # DDP's param buffer (and grad buffer) made in host memory; a line says so
        return ddp_with_params_in_host_memory(chunks, ddp, device, grads_in_host_memory(args))
    staged = stage_params_on_host(chunks, ddp_config)
    if staged:
        _print_rank0(staged)
    chunks = [ddp(chunk, i) for i, chunk in enumerate(chunks)]
    if staged:
        chunks = [chunk.to(device) for chunk in chunks]  # the rest (buffers); params are DDP's device views now
    for chunk in chunks:
        chunk.broadcast_params()  # identical replicas across DP ranks from the start
    return chunks


def build_optimizer(args, model_chunks) -> TrainingOptimizer:
    """THE offload hook: megatron-core's optimizer, or the offload engine when tiers are given."""
    config = optimizer_config(args)
    if args.offload_tiers is None:
        return get_megatron_optimizer(config, model_chunks)
    from megatron.training.offload.factory import get_offload_optimizer

    return get_offload_optimizer(args, model_chunks, config)


def build_scheduler(args, optimizer) -> OptimizerParamScheduler:
    # Steps are counted in samples, as Megatron-LM does (megatron.training.data.lr_schedule).
    return build_param_scheduler(args, optimizer, args.global_batch_size)


def _wire_model_hooks(config, model, optimizer, args) -> None:
    """What Megatron-LM's train() sets on the config so schedules can sync grads and scale loss."""
    def each_chunk(method: str):  # one function, or the list of each chunk's for the interleaved schedule
        functions = [getattr(chunk, method) for chunk in model]
        return functions[0] if len(functions) == 1 else functions

    config.finalize_model_grads_func = finalize_model_grads
    config.grad_scale_func = optimizer.scale_loss
    config.no_sync_func = each_chunk("no_sync")
    if args.overlap_grad_reduce:
        config.grad_sync_func = each_chunk("start_grad_sync")
    if args.overlap_param_gather:
        config.param_sync_func = each_chunk("start_param_sync")
    config.timers = None  # LoopTimers, set with the metrics
    config.barrier_with_L1_time = False  # timing adds no barrier between ranks (as before)


# ----------------------------------------------------------------------------- logging

def _average_loss(losses_reduced) -> Optional[torch.Tensor]:
    """'lm loss' per token over the step: (summed loss, tokens) of every micro-batch and data-parallel
    rank, as Megatron-LM reports it."""
    if not parallel_state.is_pipeline_last_stage():
        return None
    totals = torch.stack([d["lm loss"].float().view(2) for d in losses_reduced]).sum(dim=0)
    torch.distributed.all_reduce(totals, group=parallel_state.get_data_parallel_group())
    return (totals[0] / totals[1].clamp(min=1)).reshape(1)


def _print_rank0(msg: str) -> None:
    if torch.distributed.get_rank() == 0:
        print(msg, flush=True)


# ----------------------------------------------------------------------------- train / evaluate

def _with_fault_points(forward_step_func):
    """Crash-test hooks (mlp_offload.faults): 'forward' as a micro-batch starts, 'backward' when its
    gradient arrives. Only when MLP_OFFLOAD_FAULT is set."""
    if not os.environ.get("MLP_OFFLOAD_FAULT"):  # read here as runtime.fault_injection reads it
        return forward_step_func

    def forward_step(data_iterator, model):
        fault_point("forward")
        output, loss_func = forward_step_func(data_iterator, model)
        if output.requires_grad:
            output.register_hook(lambda grad: fault_point("backward"))
        return output, loss_func

    return forward_step


@dataclass(frozen=True)
class Trained:
    """What a training step changes: the model's chunks, the optimizer, the learning-rate scheduler."""
    model: list
    optimizer: object
    scheduler: object


def train_step(args, forward_step_func, data_iterator, trained: Trained, timers, hooks=None):
    model, optimizer, scheduler = trained.model, trained.optimizer, trained.scheduler
    for chunk in model:
        if getattr(optimizer, "zeroes_grads_itself", False) or grads_in_host_memory(args):
            reset_grad_accumulation(chunk)  # the update zeroes each grad as it reads it (in host memory: overwritten)
        else:
            chunk.zero_grad_buffer()
    optimizer.zero_grad()
    losses = step_schedule(model, **layer_major_flags(args))(
        forward_step_func=_with_fault_points(forward_step_func),
        data_iterator=data_iterator,
        model=model,
        num_microbatches=args.num_microbatches,
        seq_length=args.seq_length,
        micro_batch_size=args.micro_batch_size,
        forward_only=False,
    )  # the schedule times itself: 'forward-backward' in timers
    if hooks is not None:
        hooks.after_forward_backward()
    timers("optimizer", log_level=1).start()
    update_successful, grad_norm, num_zeros = optimizer.step()
    timers("optimizer").stop()
    if update_successful:
        scheduler.step(increment=args.current_global_batch_size)  # ramps with --rampup-batch-size
    # Logged as Megatron-LM logs it: the rate after the scheduler's step (checked against upstream's log).
    lr = optimizer.param_groups[0]["lr"]
    return _average_loss(losses), lr, grad_norm, num_zeros, update_successful


def evaluate(args, forward_step_func, data_iterator, model) -> Optional[float]:
    for chunk in model:
        chunk.eval()
    total, count = None, 0
    with torch.no_grad():
        for _ in range(args.eval_iters):
            losses = step_schedule(model, forward_only=True, **layer_major_flags(args))(
                forward_step_func=forward_step_func, data_iterator=data_iterator, model=model,
                num_microbatches=args.num_microbatches, seq_length=args.seq_length,
                micro_batch_size=args.micro_batch_size, forward_only=True)
            loss = _average_loss(losses)
            if loss is not None:
                total = loss if total is None else total + loss
                count += 1
    for chunk in model:
        chunk.train()
    return None if total is None else (total / count).item()


def pretrain(model_provider: Callable, datasets_provider: Callable, forward_step_func: Callable,
             argv: Optional[List[str]] = None) -> None:
    """Parse args, initialize, build everything, train, evaluate, save. A user error (flag, path,
    budget, space, checkpoint) ends the job with one line, printed once, and exit status 2."""
    with reported_once():
        _pretrain(model_provider, datasets_provider, forward_step_func, argv)


def _pretrain(model_provider, datasets_provider, forward_step_func, argv) -> None:
    started = time.time()  # --exit-duration-in-mins counts from here, as Megatron-LM's start time
    args = parse_args(argv)
    device = initialize(args)
    if args.offload_tiers is not None and not args.offload_no_cpu_one_pass:
        build_cpu_kernel_in_background()  # a first build's compile runs while the model is built
    phases = StartUpPhases(started)
    fault_injection.install_from_env()  # the crash tests' points (RANK is set by now, srun included)
    args.device_obj = device
    tokenizer = build_tokenizer(args)
    args.padded_vocab_size = padded_vocab_size(args, tokenizer)

    config = transformer_config(args)
    check_step_schedule(args, config, **layer_major_flags(args))
    phases.done("initialize")
    model = build_model(args, config, model_provider, device)
    phases.done("model")
    optimizer = build_optimizer(args, model)  # the offload engine's probes and pinned host memory
    phases.done("optimizer")
    job_facts.report(optimizer)
    scheduler = build_scheduler(args, optimizer)
    _wire_model_hooks(config, model, optimizer, args)
    total_params = counted_params(model)
    _print_rank0(f"> model parameters (all stages, one replica): {total_params} | "
                 f"TP={args.tensor_model_parallel_size} PP={args.pipeline_model_parallel_size} "
                 f"{f'VPP={len(model)} ' if len(model) > 1 else ''}"
                 f"DP={args.data_parallel_size} | micro-batches per step: {args.num_microbatches} | "
                 f"device: {device}")
    cuda_sdpa = device.type == "cuda" and args.core_attention == "sdpa"
    _print_rank0(optional_kernels.attention_line(args, admitted_cuda_kernels(config, device) if cuda_sdpa else None))
    if args.deterministic_mode:
        _print_rank0(determinism.describe(args))
    if args.num_experts is not None:
        _print_rank0(moe_metrics.moe_summary(args, config, total_params, torch.distributed.get_world_size()))
        experts = moe_metrics.experts_line(model)
        if experts:  # rank 0's stage may hold dense layers only
            _print_rank0(experts)

    if getattr(args, "moe_grouped_gemm_kernel", None) == "sequential":
        _print_rank0("> --moe-grouped-gemm: no grouped GEMM kernel here (the grouped_gemm package, or "
                     "transformer-engine on CUDA): megatron-core's sequential experts run, the same arithmetic")
    trained = Trained(model, optimizer, scheduler)
    iteration, consumed = checkpointing.resume(args, trained)
    checkpointing.forecast_space(args, trained, iteration)  # a save that will not fit, said before any step

    phases.done("checkpoint")
    eval_runs = 0 if not args.eval_interval else (args.train_iters // args.eval_interval + 1)
    train_ds, valid_ds = datasets_provider(
        args, tokenizer, train_samples=args.train_samples_total,
        eval_samples=eval_runs * args.eval_iters * args.global_batch_size)
    dp_rank, dp_size = parallel_state.get_data_parallel_rank(), parallel_state.get_data_parallel_world_size()
    train_iter = per_chunk(micro_batches(train_ds, consumed, args.micro_batch_size, dp_rank, dp_size,
                                         args.num_workers, args.seed), len(model))
    hooks = IterationHooks(args, torch.distributed.get_rank(), device)
    phases.done("data")
    _print_rank0(phases.line())

    timers = config.timers = LoopTimers(args.timing_log_level, args.timing_log_option, device)
    if getattr(optimizer, "zeroes_grads_itself", False):  # the update runs under the next forward
        timers.without_device_sync()
    metrics = build_metrics(args, optimizer, timers, iteration)
    shape = GptShape.from_config(config, args.seq_length, args.padded_vocab_size)
    offload_state_bytes = optimizer.state_bytes_per_tier() if isinstance(optimizer, ReportsIteration) else {}
    first_of_run = True
    stop = StopCheck(args.sigterm_watcher, args.exit_duration_in_mins, started)
    background = BackgroundSaves(device, args.checkpoint_worker) if args.async_save else None
    if background is not None:
        checkpointing.reserve_async_save_memory(model, optimizer, args)
    try:
        while iteration < args.train_iters:
            batch_schedule.advance(args, consumed)
            hooks.before(iteration)
            start = time.perf_counter()
            loss, lr, grad_norm, num_zeros, ok = train_step(args, forward_step_func, train_iter, trained, timers,
                                                            hooks)
            loss = loss.item() if loss is not None else None
            elapsed = time.perf_counter() - start
            iteration += 1
            consumed += args.current_global_batch_size
            hooks.after(iteration)
            nan = loss is not None and not math.isfinite(loss)
            if nan and ok and args.check_for_nan_in_loss_and_grad:
                raise RuntimeError(f"loss is {loss} at iteration {iteration}")
            moe_losses = moe_metrics.aux_losses(args)  # collective; clears megatron-core's tracker
            times = timers.take_iteration()
            flops = flops_per_iteration(shape, args.current_global_batch_size)
            # Saved in checkpoints, as Megatron-LM keeps it, for throughput over a job chain.
            args.num_floating_point_operations_so_far = getattr(args, "num_floating_point_operations_so_far", 0) + flops
            metrics.iteration(IterationRecord(
                iteration=iteration, consumed_samples=consumed, global_batch_size=args.current_global_batch_size,
                learning_rate=lr, loss_scale=float(optimizer.get_loss_scale().item()), skipped=not ok, nan=nan,
                elapsed_s=elapsed, forward_backward_s=times["forward-backward"], optimizer_s=times["optimizer"],
                forward_s=times["forward-compute"], backward_s=times["backward-compute"],
                flops=flops,
                loss=loss, grad_norm=grad_norm, num_zeros_in_grad=num_zeros if args.log_num_zeros_in_grad else None,
                params_norm=params_l2_norm(model) if args.log_params_norm else None,
                offload=optimizer.last_step_record() if isinstance(optimizer, ReportsIteration) else None,
                offload_state_bytes=offload_state_bytes, first_of_run=first_of_run, moe_losses=moe_losses))
            first_of_run = False
            if args.eval_interval and valid_ds is not None and iteration % args.eval_interval == 0:
                _run_eval(args, forward_step_func, model, valid_ds, (iteration, consumed), metrics)
                timers.take_iteration()  # evaluation's forwards are not the next iteration's
            if background is not None:
                background.poll()  # completes the last background save once every rank's write has ended
            if args.save and args.save_interval and iteration % args.save_interval == 0:
                with args.sigterm_watcher.saving_checkpoint():
                    checkpointing.save_checkpoint(iteration, trained, consumed, args, background)
            elif (args.save and args.non_persistent_save_interval and iteration % args.non_persistent_save_interval == 0
                  and iteration < args.train_iters):  # the last iteration's save, right after the loop, is persistent
                with args.sigterm_watcher.saving_checkpoint():
                    checkpointing.save_checkpoint(iteration, trained, consumed, args, background, non_persistent=True)
            reason = stop.after_iteration(time.perf_counter() - start, device)  # eval and save included
            if reason:  # the checkpoint is saved below, as at the end of training
                _print_rank0(f"> exiting at iteration {iteration} after {reason}")
                break
            if args.exit_interval and iteration % args.exit_interval == 0:
                _print_rank0(f"> exiting at iteration {iteration} (--exit-interval)")
                break
        if args.save and not (args.save_interval and iteration % args.save_interval == 0):
            checkpointing.save_checkpoint(iteration, trained, consumed, args, background)
        if background is not None:
            background.finish()  # exit only once the last background write is complete
            background.close()
        if torch.distributed.get_rank() == 0:
            finish_retiring()  # and once the checkpoints it retired are gone
    except BaseException:
        if background is not None:
            background.abandon()  # its directory stays marked in progress: never resumed from
        raise
    finally:
        hooks.stop()
        metrics.close()
        if isinstance(optimizer, HoldsResources):
            optimizer.close()
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()


def _run_eval(args, forward_step_func, model, valid_ds, progress: Tuple[int, int], metrics):
    """``progress``: (iterations, samples consumed) so far."""
    iteration, consumed = progress
    dp_rank, dp_size = parallel_state.get_data_parallel_rank(), parallel_state.get_data_parallel_world_size()
    # Each evaluation reads its own slice of the validation set, so results are reproducible on resume.
    first = (iteration // args.eval_interval) * args.eval_iters * args.global_batch_size
    it = per_chunk(micro_batches(valid_ds, first, args.micro_batch_size, dp_rank, dp_size, args.num_workers,
                                 args.seed), len(model))
    loss = evaluate(args, forward_step_func, it, model)
    if loss is not None:
        metrics.validation(ValidationRecord(iteration=iteration, consumed_samples=consumed, loss=loss))
