"""The metrics a run writes: this rank's sinks, built once from the flags."""

from __future__ import annotations

import torch

from megatron.training.metrics.console import Console
from megatron.training.metrics.records import LossLog, Metrics, TimingLog, is_last_rank
from megatron.training.metrics.sinks import OffloadTelemetry, TensorBoard, WandB
from megatron.training.metrics.timers import LoopTimers
from megatron.training.offload.flags import per_rank_path
from megatron.training.runtime.optimizer_interface import ReportsIteration


def build_metrics(args, optimizer, timers: LoopTimers, resume_iteration: int) -> Metrics:
    """This rank's sinks: the run logs everywhere they apply; console, TensorBoard and W&B on the
    last rank. megatron-core's timers are written to TensorBoard/W&B through the same writers."""
    world_size = torch.distributed.get_world_size()
    sinks = [LossLog(args.loss_log, resume_iteration), TimingLog(args.timing_log, resume_iteration)]
    telemetry_path = per_rank_path(getattr(args, "offload_telemetry_log", None), torch.distributed.get_rank())
    if telemetry_path and isinstance(optimizer, ReportsIteration):
        sinks.append(OffloadTelemetry(telemetry_path))
    tensorboard = wandb = None
    if is_last_rank():
        sinks.append(Console(args, world_size))
        if args.tensorboard_dir:
            tensorboard = TensorBoard(args, world_size)
            sinks.append(tensorboard)
        if args.wandb_project:
            wandb = WandB(args, world_size)
            sinks.append(wandb)
    timer_writers = None
    if args.log_timers_to_tensorboard:  # one entry per writer on every rank: writing gathers across ranks
        timer_writers = [tensorboard.writer if tensorboard else None, wandb.wandb if wandb else None]
    return Metrics(sinks, timers, args.log_interval, timer_writers)
