"""Progress of long set-up and checkpoint steps: a line as each starts and one as it ends, with
its size in GB and rate in GB/s, so a job that seems stuck shows what it is moving and how fast;
and what such a step tells once for all ranks (the slowest rank's figures, a line from rank 0)."""

from __future__ import annotations

import time
from contextlib import contextmanager
from typing import Callable, Optional

import torch

from mlp_offload import GB


def gb_and_rate(nbytes: float, seconds: float) -> str:
    return f"{nbytes / GB:.3f} GB in {seconds:.1f} s ({nbytes / GB / max(seconds, 1e-9):.2f} GB/s)"


def model_device(model) -> torch.device:
    """Where the model computes, and collectives over figures run (NCCL reduces no CPU tensors): as its chunk
    was told where params and grads live in host memory (``compute_device``), else its DDP grad buffer's device
    (with --offload-params host the params are in host memory), else its params'."""
    told = getattr(model[0], "compute_device", None)
    if told is not None:
        return told
    buffers = getattr(model[0], "buffers", None)
    if isinstance(buffers, list) and buffers:
        return buffers[0].grad_data.device
    return next(model[0].parameters()).device


def slowest_rank(figures, model) -> list:
    """Each figure's maximum over all ranks."""
    figures = torch.tensor(figures, dtype=torch.float64, device=model_device(model))
    torch.distributed.all_reduce(figures, op=torch.distributed.ReduceOp.MAX)
    return figures.tolist()


def print_rank0(line: str) -> None:
    if torch.distributed.get_rank() == 0:
        print(line, flush=True)


class Step:
    """What a step moved, told when known (often only at its end)."""

    def __init__(self):
        self.nbytes: Optional[float] = None


@contextmanager
def reported_step(what: str, say: Callable[[str], None], size_bytes: Optional[float] = None):
    """``say`` a line at the start (with the size when known) and one at the end with size and rate."""
    step = Step()
    step.nbytes = size_bytes
    size = f" ({size_bytes / GB:.3f} GB)" if size_bytes else ""
    say(f"{what}{size} ...")
    started = time.perf_counter()
    yield step
    seconds = time.perf_counter() - started
    moved = gb_and_rate(step.nbytes, seconds) if step.nbytes is not None else f"in {seconds:.1f} s"
    say(f"{what}: done, {moved}")


class MemoryGrowth:
    """How far this process's resident memory rises above its level at construction: the kernel's
    high-water mark (VmHWM), reset then through /proc/self/clear_refs. ``peak_bytes()`` is None where
    /proc does not allow the reset (the figure would be the process's lifetime peak)."""

    def __init__(self):
        self.base = _status_kb("VmRSS")
        try:
            with open("/proc/self/clear_refs", "w") as f:
                f.write("5")  # resets VmHWM to the current RSS
            self.resettable = True
        except OSError:
            self.resettable = False

    def peak_bytes(self) -> Optional[int]:
        peak = _status_kb("VmHWM")
        if not self.resettable or peak is None or self.base is None:
            return None
        return max(0, peak - self.base) * 1024


def _status_kb(field: str) -> Optional[int]:
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1])
    except OSError:
        pass
    return None


class StartUpPhases:
    """How long each start-up phase took, for one line before the first iteration: where the time to
    the first step goes (on a GPU mostly the optimizer's: its probes and pinning host memory)."""

    def __init__(self, started: float):
        self._started = self._last = started
        self.phases = []

    def done(self, phase: str) -> None:
        now = time.time()
        self.phases.append((phase, now - self._last))
        self._last = now

    def line(self) -> str:
        parts = " | ".join(f"{phase} {seconds:.1f}" for phase, seconds in self.phases)
        return f"> start-up (s): {parts} | total {self._last - self._started:.1f}"
