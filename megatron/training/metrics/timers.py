"""megatron-core's Timers for the training loop and its schedules, plus per-iteration readings.

``LoopTimers`` is what ``config.timers`` is set to, as in Megatron-LM: the schedules time
'forward-backward' (level 1) and, per micro-batch, 'forward-compute'/'backward-compute' (level 2)
through it, and train_step times 'optimizer'. Two additions for the per-iteration --timing-log:

- level-1 timers always run (forward-backward and optimizer are in every timing-log record);
  what --timing-log-level chooses is which timers are printed and written;
- the forward/backward compute of each micro-batch is also summed as CUDA events (on a GPU), read
  once per iteration: megatron-core's level-2 timers synchronize the device at every micro-batch.
"""

from __future__ import annotations

import time
from typing import Dict, List

import torch
from megatron.core.timers import Timer, Timers

from megatron.training.runtime.core_private import install_timer

COMPUTE_SPANS = ("forward-compute", "backward-compute")
STEP_TIMERS = ("forward-backward", "optimizer")

# Megatron-LM's training_log prints these timers at each --timing-log-level.
LEVEL_1_TIMERS = ["forward-backward", "layernorm-grads-all-reduce", "embedding-grads-all-reduce", "all-grads-sync",
                  "params-all-gather", "optimizer-copy-to-main-grad", "optimizer-unscale-and-check-inf",
                  "optimizer-clip-main-grad", "optimizer-count-zeros", "optimizer-inner-step",
                  "optimizer-copy-main-to-model-params", "optimizer"]
LEVEL_2_TIMERS = ["batch-generator", "forward-compute", "backward-compute", "forward-recv", "forward-send",
                  "backward-recv", "backward-send", "forward-send-forward-recv", "forward-send-backward-recv",
                  "backward-send-forward-recv", "backward-send-backward-recv",
                  "forward-backward-send-forward-backward-recv"]


def timers_to_log(level: int) -> List[str]:
    return (LEVEL_1_TIMERS if level >= 1 else []) + (LEVEL_2_TIMERS if level >= 2 else [])


class LoopTimers:
    def __init__(self, timing_log_level: int, timing_log_option: str, device: torch.device):
        self.core = Timers(max(timing_log_level, 1), timing_log_option)
        self.names_to_log = timers_to_log(timing_log_level)
        self._spans = _ComputeSpans(device)
        self._read = {name: 0.0 for name in STEP_TIMERS}  # core timers' elapsed at the last reading

    def __call__(self, name, log_level=None):
        timer = self.core(name, log_level)
        if name in COMPUTE_SPANS:
            return _BothTimers(timer, self._spans, name)
        return timer

    def without_device_sync(self) -> None:
        """'forward-backward' and 'optimizer' on the host clock only: with the update under the next
        forward, their device synchronisation at start and stop made the host wait for the whole
        update before launching the forward, and the overlap gained nothing."""
        for name in STEP_TIMERS:
            install_timer(self.core, name, HostTimer(name), 1)

    def take_iteration(self) -> Dict[str, float]:
        """Seconds since the last call: forward-backward, optimizer, forward-compute and
        backward-compute. The core timers keep accumulating for the interval's print."""
        taken = {}
        for name in STEP_TIMERS:
            total = self.core(name, 1).elapsed(reset=False)
            taken[name] = total - self._read[name]
            self._read[name] = total
        for name in COMPUTE_SPANS:
            taken[name] = self._spans.pop(name)
        return taken

    def log_interval(self, iteration: int, log_interval: int, writers=None, reset: bool = True) -> None:
        """On every rank (megatron-core gathers the timers across ranks): the last rank prints the
        --timing-log-level timers averaged over the interval; ``writers`` (with
        --log-timers-to-tensorboard: a TensorBoard writer, the wandb module, or None where this rank
        has none; as many on every rank) get their maxima. Then, with ``reset``, a new interval."""
        for writer in writers or ():
            self.core.write(self.names_to_log, writer, iteration, normalizer=log_interval, reset=False)
        text = self.core.get_all_timers_string(self.names_to_log, normalizer=log_interval, reset=reset)
        if text and torch.distributed.get_rank() == torch.distributed.get_world_size() - 1:
            print(text, flush=True)
        if reset:
            for name in STEP_TIMERS:  # also when not printed (--timing-log-level 0)
                self.core(name, 1).reset()
            self._read = {name: 0.0 for name in STEP_TIMERS}


class _ComputeSpans:
    """Each name's intervals of the current iteration: CUDA events on a GPU (no syncs), else wall time."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"
        self._open: Dict[str, object] = {}
        self._closed: Dict[str, list] = {}

    def _now(self):
        if not self.cuda:
            return time.perf_counter()
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def start(self, name):
        self._open[name] = self._now()

    def stop(self, name):
        self._closed.setdefault(name, []).append((self._open.pop(name), self._now()))

    def pop(self, name) -> float:
        spans = self._closed.pop(name, [])
        if self.cuda:
            if spans:
                spans[-1][1].synchronize()
            return sum(a.elapsed_time(b) for a, b in spans) / 1000.0
        return sum(b - a for a, b in spans)


class _BothTimers:
    def __init__(self, timer, spans: _ComputeSpans, name: str):
        self.timer, self.spans, self.name = timer, spans, name

    def start(self, barrier=False):
        self.spans.start(self.name)
        self.timer.start(barrier=barrier)

    def stop(self, barrier=False):
        self.timer.stop(barrier=barrier)
        self.spans.stop(self.name)


class HostTimer(Timer):
    """megatron-core's Timer without ``torch.cuda.synchronize()``: host time only."""

    def start(self, barrier=False):
        assert not self._started, "timer has already been started"
        if barrier:
            torch.distributed.barrier(group=self._barrier_group)
        self._start_time = time.time()
        self._started = True

    def stop(self, barrier=False):
        assert self._started, "timer is not started"
        if barrier:
            torch.distributed.barrier(group=self._barrier_group)
        elapsed = time.time() - self._start_time
        self._elapsed += elapsed
        self._active_time += elapsed
        self._started = False
