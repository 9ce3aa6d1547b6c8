"""One iteration's figures, written out: the console line, the loss log and the timing log.

The JSON-lines writer here also serves the offload optimizer's per-step telemetry.
"""

from __future__ import annotations

import json
import os
from typing import Optional

from megatron.core import parallel_state

from megatron.training.optimizer_interface import ReportsIteration


def is_logging_rank() -> bool:
    """The last pipeline stage's first rank (TP 0, DP 0) has the loss."""
    return (parallel_state.is_pipeline_last_stage() and parallel_state.get_tensor_model_parallel_rank() == 0
            and parallel_state.get_data_parallel_rank() == 0)


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


class _RunLog(JsonLines):
    """Written by the logging rank: a fresh run starts the file anew, a resumed one appends."""

    def __init__(self, path: Optional[str], resume_iteration: int):
        super().__init__(path if is_logging_rank() else None, "a" if resume_iteration else "w")


class LossLog(_RunLog):
    """One line per iteration; floats via repr() so runs can be compared bit for bit."""

    def write(self, iteration, loss, lr, grad_norm):
        fields = [("iteration", str(iteration)), ("loss", repr(float(loss))), ("lr", repr(float(lr))),
                  ("grad_norm", repr(float(grad_norm)) if grad_norm is not None else "null")]
        self.write_line("{" + ", ".join(f'"{k}": {v}' for k, v in fields) + "}")


class TimingLog(_RunLog):
    """Per-iteration wall-clock phases (CUDA-synchronized), for benchmarks."""

    def write(self, iteration, elapsed_s, fb_s, opt_s, fwd_s=None, bwd_s=None):
        # forward / backward: the pipeline schedule's compute timers, summed over micro-batches
        # (backward includes activation recompute).
        self.write_record({"iteration": iteration, "elapsed_s": elapsed_s,
                           "forward_backward_s": fb_s, "optimizer_s": opt_s,
                           "forward_s": fwd_s, "backward_s": bwd_s})


def log_line(args, iteration, loss, lr, grad_norm, elapsed_s, fb_s, opt_s, optimizer, ok=True,
             fwd_s=None, bwd_s=None) -> str:
    """The iteration's console line, in Megatron-LM's format, with the optimizer's own part last."""
    tokens_per_s = args.global_batch_size * args.seq_length / max(elapsed_s, 1e-9)
    parts = [
        f"iteration {iteration:8d}/{args.train_iters:8d}",
        f"consumed samples: {iteration * args.global_batch_size:10d}",
        f"elapsed time per iteration (ms): {elapsed_s * 1000:.1f}",
        f"forward-backward (ms): {fb_s * 1000:.1f}",
        *([f"forward (ms): {fwd_s * 1000:.1f}", f"backward (ms): {bwd_s * 1000:.1f}"] if fwd_s is not None else []),
        f"optimizer (ms): {opt_s * 1000:.1f}",
        f"tokens/s: {tokens_per_s:.1f}",
        f"learning rate: {lr:.6E}",
        f"lm loss: {loss:.6E}",
        f"grad norm: {grad_norm:.4f}" if grad_norm is not None else "grad norm: n/a",
    ]
    if args.fp16:
        parts.append(f"loss scale: {float(optimizer.get_loss_scale()):.1f}")
    if not ok:
        parts.append("skipped iteration (inf/nan grads)")
    if isinstance(optimizer, ReportsIteration):
        extra = optimizer.log_line()
        if extra:
            parts.append(str(extra))
    return " | ".join(parts) + " |"
