"""TensorBoard, Weights & Biases and the offload engine's telemetry file as metrics sinks.

TensorBoard and W&B get Megatron-LM's scalar names ('learning-rate', 'batch-size', 'lm loss',
'loss-scale', 'grad-norm', ..., TensorBoard also each '... vs samples'), every
--tensorboard-log-interval iterations, plus the offload engine's figures (offload_figures). Both
live on the last rank, as in Megatron-LM.
"""

from __future__ import annotations

import math
import os
from dataclasses import asdict
from typing import Dict, Optional

import torch

from megatron.training.model.flops import tflops_per_gpu
from megatron.training.metrics.records import IterationRecord, JsonLines, Sink, ValidationRecord
from megatron.training.metrics.offload_figures import step_scalars


def iteration_scalars(record: IterationRecord, args) -> Dict[str, float]:
    """The iteration's scalars under Megatron-LM's names (without the 'vs samples' copies)."""
    scalars = {"learning-rate": record.learning_rate, "batch-size": record.global_batch_size}
    if record.loss is not None and not record.skipped:
        scalars["lm loss"] = record.loss
    if args.log_loss_scale_to_tensorboard:
        scalars["loss-scale"] = record.loss_scale
    if record.grad_norm is not None:
        scalars["grad-norm"] = record.grad_norm
    if record.num_zeros_in_grad is not None:
        scalars["num-zeros"] = record.num_zeros_in_grad
    if record.params_norm is not None:
        scalars["params-norm"] = record.params_norm
    scalars.update(record.moe_losses)  # 'load_balancing_loss', 'z_loss', ... as Megatron-LM names them
    return scalars


class IntervalTime:
    """With --log-timers-to-tensorboard, at each --log-interval: the interval's mean iteration time
    and TFLOP/s, as the console line shows them."""

    def __init__(self, args, world_size: int):
        self.args, self.world_size = args, world_size
        self.seconds, self.iterations = 0.0, 0

    def scalars(self, record: IterationRecord) -> Dict[str, float]:
        self.seconds += record.elapsed_s
        self.iterations += 1
        if not self.args.log_timers_to_tensorboard or not record.ends_interval(self.args.log_interval):
            return {}
        per_iteration = self.seconds / self.iterations
        self.seconds, self.iterations = 0.0, 0
        scalars = {"iteration-time": per_iteration}
        if self.args.log_throughput:
            scalars["throughput"] = tflops_per_gpu(record.flops, per_iteration, self.world_size)
        return scalars


def memory_scalars(args) -> Dict[str, float]:
    if not (args.log_memory_to_tensorboard and torch.cuda.is_available()):
        return {}
    stats = torch.cuda.memory_stats()
    return {"mem-reserved-bytes": stats["reserved_bytes.all.current"],
            "mem-allocated-bytes": stats["allocated_bytes.all.current"],
            "mem-max-allocated-bytes": stats["allocated_bytes.all.peak"],
            "mem-allocated-count": stats["allocation.all.current"]}


def offload_scalars(record: IterationRecord) -> Dict[str, float]:
    if record.offload is None:
        return {}
    return step_scalars(record.offload, record.offload_state_bytes)


class TensorBoard(Sink):
    def __init__(self, args, world_size: int):
        from torch.utils.tensorboard import SummaryWriter

        print("> setting tensorboard ...", flush=True)
        self.writer = SummaryWriter(log_dir=args.tensorboard_dir, max_queue=args.tensorboard_queue_size)
        self.args = args
        self.interval_time = IntervalTime(args, world_size)

    def iteration(self, record: IterationRecord) -> None:
        add = self.writer.add_scalar
        if record.iteration % self.args.tensorboard_log_interval == 0:
            for name, value in iteration_scalars(record, self.args).items():
                add(name, value, record.iteration)
                add(f"{name} vs samples", value, record.consumed_samples)
            for name, value in {**memory_scalars(self.args), **offload_scalars(record)}.items():
                add(name, value, record.iteration)
        for name, value in self.interval_time.scalars(record).items():
            add(name, value, record.iteration)

    def validation(self, record: ValidationRecord) -> None:
        add = self.writer.add_scalar
        add("lm loss validation", record.loss, record.iteration)
        add("lm loss validation vs samples", record.loss, record.consumed_samples)
        if self.args.log_validation_ppl_to_tensorboard:
            ppl = math.exp(min(20, record.loss))
            add("lm loss validation ppl", ppl, record.iteration)
            add("lm loss validation ppl vs samples", ppl, record.consumed_samples)

    def close(self) -> None:
        self.writer.close()


class WandB(Sink):
    """A W&B run; with WANDB_MODE=offline it is written under --wandb-save-dir only."""

    def __init__(self, args, world_size: int):
        import wandb

        save_dir = args.wandb_save_dir or os.path.join(args.save, "wandb")
        os.makedirs(save_dir, exist_ok=True)
        config = {k: v for k, v in vars(args).items() if isinstance(v, (int, float, str, bool, list, type(None)))}
        self.run = wandb.init(dir=save_dir, name=args.wandb_exp_name, project=args.wandb_project, config=config)
        self.wandb = wandb  # megatron-core's Timers.write recognises the module itself
        self.args = args
        self.interval_time = IntervalTime(args, world_size)

    def iteration(self, record: IterationRecord) -> None:
        scalars = self.interval_time.scalars(record)
        if record.iteration % self.args.tensorboard_log_interval == 0:
            scalars.update({"samples vs steps": record.consumed_samples, **iteration_scalars(record, self.args),
                            **memory_scalars(self.args), **offload_scalars(record)})
        if scalars:
            self.run.log(scalars, step=record.iteration)

    def validation(self, record: ValidationRecord) -> None:
        self.run.log({"lm loss validation": record.loss}, step=record.iteration)

    def close(self) -> None:
        self.run.finish()


class OffloadTelemetry(JsonLines, Sink):
    """--offload-telemetry-log: the engine's record of every step that updated, as JSON lines, on
    each rank whose path the flag gives (``offload/flags.py``: ``per_rank_path``)."""

    def __init__(self, path: Optional[str]):
        super().__init__(path)

    def iteration(self, record: IterationRecord) -> None:
        if record.offload is not None and not record.offload.skipped:
            self.write_record(asdict(record.offload))
