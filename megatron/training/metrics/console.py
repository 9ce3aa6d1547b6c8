"""The console: Megatron-LM's iteration and validation lines, field for field, so that the tools
written for its logs read ours; the offload engine's figures follow as ``key: value |`` pairs.

As Megatron-LM's ``training_log``: the loss and the time per iteration are averaged over the
--log-interval (the loss over the iterations that stepped), skipped and NaN iterations are counted
over it, learning rate, loss scale and grad norm are the last iteration's, and the job's first
iteration is printed too (off the interval's boundary, it stays in the interval it opens).
"""

from __future__ import annotations

import math
import sys
from datetime import datetime
from typing import List

from megatron.training.model.flops import tflops_per_gpu
from megatron.training.metrics.records import IterationRecord, Sink, ValidationRecord
from megatron.training.metrics.offload_figures import IterationModel, OffloadInterval


class _Interval:
    def __init__(self):
        self.reset()

    def reset(self) -> None:
        self.advanced = self.skipped = self.nan = 0
        self.loss_sum = 0.0
        self.moe_sums = {}  # MoE aux loss name -> sum over the interval's iterations
        self.elapsed_s = 0.0
        self.offload = OffloadInterval()

    def add(self, record: IterationRecord) -> None:
        self.elapsed_s += record.elapsed_s
        for name, value in record.moe_losses.items():  # every iteration, as upstream's total_loss_dict
            if not name.startswith("moe/"):
                self.moe_sums[name] = self.moe_sums.get(name, 0.0) + value
        if record.skipped:
            self.skipped += 1
            self.nan += int(record.nan)
        else:
            self.advanced += 1
            self.loss_sum += record.loss if record.loss is not None else 0.0
        if record.offload is not None:
            self.offload.add(record.offload)

    @property
    def iterations(self) -> int:
        return self.advanced + self.skipped


def training_line(record: IterationRecord, interval: _Interval, train_iters: int, world_size: int,
                  log_throughput: bool) -> str:
    per_iteration_s = interval.elapsed_s / max(interval.iterations, 1)
    line = f" [{datetime.now().strftime('%Y-%m-%d %H:%M:%S.%f')}]"
    line += f" iteration {record.iteration:8d}/{train_iters:8d} |"
    line += f" consumed samples: {record.consumed_samples:12d} |"
    line += f" elapsed time per iteration (ms): {per_iteration_s * 1000.0:.1f} |"
    if log_throughput:
        line += f" throughput per GPU (TFLOP/s/GPU): {tflops_per_gpu(record.flops, per_iteration_s, world_size):.1f} |"
    line += f" learning rate: {record.learning_rate:.6E} |"
    line += f" global batch size: {record.global_batch_size:5d} |"
    loss = interval.loss_sum / max(interval.advanced, 1)
    if loss > 0.0:  # as Megatron-LM: an interval of skipped iterations only has no loss to show
        line += f" lm loss: {loss:.6E} |"
    for name, total in interval.moe_sums.items():  # after 'lm loss', averaged as it is (upstream)
        if total / max(interval.advanced, 1) > 0.0:
            line += f" {name}: {total / max(interval.advanced, 1):.6E} |"
    line += f" loss scale: {record.loss_scale:.1f} |"
    if record.grad_norm is not None:
        line += f" grad norm: {record.grad_norm:.3f} |"
    if record.num_zeros_in_grad is not None:
        line += f" num zeros: {record.num_zeros_in_grad} |"
    if record.params_norm is not None:
        line += f" params norm: {record.params_norm:.3f} |"
    line += f" number of skipped iterations: {interval.skipped:3d} |"
    line += f" number of nan iterations: {interval.nan:3d} |"
    line += "".join(f" {key}: {value} |" for key, value in interval.offload.console_pairs(interval.iterations))
    return line


def validation_lines(record: ValidationRecord) -> List[str]:
    """Megatron-LM's three lines: dashes, the losses, dashes as long as the text plus one."""
    text = f" validation loss at iteration {record.iteration} | "
    text += f"lm loss value: {record.loss:.6E} | "
    text += f"lm loss PPL: {math.exp(min(20, record.loss)):.6E} | "
    dashes = "-" * (len(text) + 1)
    return [dashes, text, dashes]


class Console(Sink):
    """Prints on the rank it is built on (the last one, as Megatron-LM's print_rank_last)."""

    def __init__(self, args, world_size: int):
        self.log_interval = args.log_interval
        self.train_iters = args.train_iters
        self.log_throughput = args.log_throughput
        self.world_size = world_size
        self.interval = _Interval()
        micro_batches = getattr(args, "global_batch_size", 1) // max(
            1, getattr(args, "micro_batch_size", 1) * getattr(args, "data_parallel_size", 1))
        self.iteration_model = IterationModel(micro_batches, getattr(args, "recompute_granularity", None) == "full")

    def iteration(self, record: IterationRecord) -> None:
        self.interval.add(record)
        if record.offload is not None:
            predicted = self.iteration_model.observe(record.elapsed_s, record.offload, record.first_of_run)
            self.interval.offload.add_prediction(record.elapsed_s, predicted)
        if record.is_printed(self.log_interval):
            print(training_line(record, self.interval, self.train_iters, self.world_size, self.log_throughput),
                  flush=True)
            if record.ends_interval(self.log_interval):
                self.interval.reset()

    def validation(self, record: ValidationRecord) -> None:
        for line in validation_lines(record):
            sys.stdout.write(line + "\n")  # one write per line: other ranks' lines interleave whole
        sys.stdout.flush()
