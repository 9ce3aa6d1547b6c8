"""One metrics record per iteration (and per evaluation), handed to every sink.

The loop builds an ``IterationRecord`` on every rank and gives it to ``Metrics``, which fans it
out to the sinks this rank has: the console line (``metrics/console.py``), the --loss-log and --timing-log
JSON lines (here), TensorBoard, W&B and the engine's telemetry (``metrics/sinks.py``). Which rank writes
what follows Megatron-LM: the console, TensorBoard and W&B on the last rank; the loss and timing
logs, as before, on the last pipeline stage's first rank.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from typing import Dict, List, Optional

import torch
from megatron.core import parallel_state


def is_logging_rank() -> bool:
    """The last pipeline stage's first rank (TP 0, DP 0) has the loss."""
    return (parallel_state.is_pipeline_last_stage() and parallel_state.get_tensor_model_parallel_rank() == 0
            and parallel_state.get_data_parallel_rank() == 0)


def is_last_rank() -> bool:
    """Where Megatron-LM prints its iteration line and keeps its TensorBoard and W&B writers."""
    return torch.distributed.get_rank() == torch.distributed.get_world_size() - 1


@dataclass
class IterationRecord:
    iteration: int
    consumed_samples: int
    global_batch_size: int
    learning_rate: float
    loss_scale: float
    skipped: bool  # the optimizer did not step (fp16 overflow)
    nan: bool  # skipped with a NaN/inf loss
    elapsed_s: float  # the whole iteration, wall clock
    forward_backward_s: float
    optimizer_s: float
    forward_s: float  # the schedule's forward compute, summed over micro-batches
    backward_s: float  # ... and backward (with activation recompute)
    flops: float  # model FLOPs of the iteration (flops.py)
    loss: Optional[float] = None  # 'lm loss' on the last pipeline stage, else None
    grad_norm: Optional[float] = None
    num_zeros_in_grad: Optional[int] = None
    params_norm: Optional[float] = None
    offload: Optional[object] = None  # the engine's StepRecord, with the offload optimizer
    offload_state_bytes: Dict[str, int] = field(default_factory=dict)
    first_of_run: bool = False  # Megatron-LM prints the job's first iteration whatever --log-interval
    moe_losses: Dict[str, float] = field(default_factory=dict)  # MoE aux losses (metrics/moe.py), every rank

    def is_printed(self, log_interval: int) -> bool:
        return self.iteration % log_interval == 0 or self.first_of_run

    def ends_interval(self, log_interval: int) -> bool:
        """A first iteration printed off the interval's boundary stays in the interval it opens
        (Megatron-LM keeps it even on the boundary, then averages two iterations at --log-interval 1)."""
        return self.iteration % log_interval == 0


@dataclass
class ValidationRecord:
    iteration: int
    consumed_samples: int
    loss: float  # 'lm loss' over --eval-iters batches


class Sink:
    """Where records go; each sink ignores what it does not show."""

    def iteration(self, record: IterationRecord) -> None:
        pass

    def validation(self, record: ValidationRecord) -> None:
        pass

    def close(self) -> None:
        pass


class Metrics:
    """The sinks of this rank, fed the same records, plus megatron-core's timers (collective:
    every rank reads them at the same iterations)."""

    def __init__(self, sinks: List[Sink], timers=None, log_interval: int = 1, timer_writers=None):
        self.sinks = sinks
        self.timers = timers
        self.log_interval = log_interval
        self.timer_writers = timer_writers

    def iteration(self, record: IterationRecord) -> None:
        for sink in self.sinks:
            sink.iteration(record)
        if self.timers is not None and record.is_printed(self.log_interval):
            self.timers.log_interval(record.iteration, self.log_interval, self.timer_writers,
                                     reset=record.ends_interval(self.log_interval))

    def validation(self, record: ValidationRecord) -> None:
        for sink in self.sinks:
            sink.validation(record)

    def close(self) -> None:
        for sink in self.sinks:
            sink.close()


# ----------------------------------------------------------------------------- JSON-lines files

class JsonLines:
    """A JSON-lines file, each line flushed as it is written; with no path it writes nothing."""

    def __init__(self, path: Optional[str], mode: str = "a"):
        self.file = None
        if path:
            os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
            self.file = open(path, mode)

    def write_line(self, text: str) -> None:
        if self.file is not None:
            self.file.write(text + "\n")
            self.file.flush()

    def write_record(self, record: dict) -> None:
        self.write_line(json.dumps(record))

    def close(self):
        if self.file is not None:
            self.file.close()


class _RunLog(JsonLines, Sink):
    """Written by the logging rank: a fresh run starts the file anew, a resumed one appends."""

    def __init__(self, path: Optional[str], resume_iteration: int):
        super().__init__(path if is_logging_rank() else None, "a" if resume_iteration else "w")


class LossLog(_RunLog):
    """One line per iteration; floats via repr() so runs can be compared bit for bit (no timings)."""

    def iteration(self, record: IterationRecord) -> None:
        if record.loss is None:
            return
        fields = [("iteration", str(record.iteration)), ("loss", repr(float(record.loss))),
                  ("lr", repr(float(record.learning_rate))),
                  ("grad_norm", repr(float(record.grad_norm)) if record.grad_norm is not None else "null")]
        self.write_line("{" + ", ".join(f'"{k}": {v}' for k, v in fields) + "}")


class TimingLog(_RunLog):
    """Per-iteration wall-clock phases (CUDA-synchronized), for benchmarks."""

    def iteration(self, record: IterationRecord) -> None:
        self.write_record({"iteration": record.iteration, "elapsed_s": record.elapsed_s,
                           "forward_backward_s": record.forward_backward_s, "optimizer_s": record.optimizer_s,
                           "forward_s": record.forward_s, "backward_s": record.backward_s})
