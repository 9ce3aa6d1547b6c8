"""SIGTERM (torchrun stopping the survivors of a failed rank, SLURM at a time limit) and the
signal that asks for a save before exiting (``--exit-signal-handler``, ``--exit-signal``).

Python runs signal handlers in the main thread only, between bytecodes; a rank blocked in a
collective whose peer has died never gets there, and torchrun SIGKILLs it later with its swap
files still on disk. So the C-level handler's wake-up byte (``signal.set_wakeup_fd``) wakes a
watcher thread instead, whatever the main thread is doing.

- SIGTERM without ``--exit-signal-handler`` (or with another ``--exit-signal``): the watcher
  removes this process's offload swap namespaces at once and exits with status 143.
- The save signal (SIGTERM by default, as Megatron-LM): the watcher raises a flag that the training
  loop reads after every iteration (``StopCheck``: all ranks agree through one all-reduce); the loop
  saves a complete checkpoint and exits 0. If the loop has not reached an iteration boundary in time
  (a peer died, so the collective never returns; or no iteration ran yet), the watcher cleans up and
  exits as above. torchrun before 2.12 SIGKILLs its workers 30 s after forwarding a SIGTERM, so a
  longer save needs ``--exit-signal SIGUSR1`` sent to the ranks alone (see examples/slurm).

SIGQUIT (``kill -QUIT <rank pid>``) prints every thread's Python stack to stderr and training goes
on: what a rank that seems stuck is doing. The watcher prints them, holding the GIL, so no frame changes
under it: faulthandler's C-level dump reads other threads' frames while they run, and a rank crashed
with SIGSEGV in it. A thread blocked in a collective, a lock or I/O has let the GIL go; one holding it
inside C code would hold the dump back. A forked checkpoint writer prints its own from its main thread.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import sys
import threading
import time
from typing import Optional

import torch

from mlp_offload import release_swap_namespaces

EXIT_ON_SIGTERM = 128 + signal.SIGTERM
STUCK_AFTER_MIN_S = 60.0  # the loop must reach an iteration boundary within max(this, 3 x slowest iteration)


class SigtermWatcher:
    def __init__(self, save_on: Optional[signal.Signals]):
        self.save_on = save_on  # the signal that asks for a save, or None
        self.save_on_signal = save_on is not None
        self.requested = threading.Event()  # a SIGTERM arrived (read by the loop)
        self.acknowledged = threading.Event()  # every rank agreed to stop: the loop is saving
        self.saving = threading.Event()  # a checkpoint save is under way: give it the time it takes
        self.slowest_iteration_s: Optional[float] = None
        self._reader, writer = socket.socketpair()
        writer.setblocking(False)
        self._writer = writer  # kept open: the C handler writes the signal number into it
        for signum in {signal.SIGTERM, save_on or signal.SIGTERM, signal.SIGQUIT}:
            signal.signal(signum, lambda signum, frame: None)  # the watcher acts, not the main thread
        signal.set_wakeup_fd(writer.fileno(), warn_on_full_buffer=False)
        os.register_at_fork(after_in_child=_quiet_in_child)
        threading.Thread(target=self._watch, name="signal-watcher", daemon=True).start()

    @contextlib.contextmanager
    def saving_checkpoint(self):
        self.saving.set()
        try:
            yield
        finally:
            self.saving.clear()

    def iteration_done(self, seconds: float) -> None:
        self.slowest_iteration_s = max(seconds, self.slowest_iteration_s or 0.0)

    def _watch(self) -> None:
        """Reads the signals' wake-up bytes: SIGQUIT's stacks here, a stop on a thread of its own (this one
        goes on printing stacks while a stop waits for the loop)."""
        stopping = False
        while True:
            signum = self._reader.recv(1)[0]
            if signum == signal.SIGQUIT:
                print_stacks("SIGQUIT", leave_out=threading.get_ident())
            elif signum in (signal.SIGTERM, self.save_on) and not stopping:
                stopping = True
                threading.Thread(target=self._stop, args=(signum,), name="signal-stop", daemon=True).start()

    def _stop(self, signum: int) -> None:
        name = signal.Signals(signum).name
        if signum == self.save_on and self.slowest_iteration_s is not None:
            self.requested.set()
            _say(f"{name} received: saving a checkpoint after the current iteration (--exit-signal-handler)")
            patience = max(STUCK_AFTER_MIN_S, 3 * self.slowest_iteration_s)
            deadline = time.monotonic() + patience
            while not self.acknowledged.wait(0.5):
                if self.saving.is_set():  # an interval save in progress: let it end
                    deadline = time.monotonic() + patience
                elif time.monotonic() > deadline:
                    break
            else:
                return  # the main thread saves and exits; torchrun or SLURM bound how long that may take
            _say(f"{name}: no iteration boundary reached in {patience:.0f} s (a rank gone?): not saving")
        release_swap_namespaces()
        _say(f"{name}: removed this rank's offload swap files; exiting")
        os._exit(EXIT_ON_SIGTERM)


def print_stacks(why: str, leave_out: Optional[int] = None) -> None:
    """Every thread's Python stack but ``leave_out``'s (a thread ident), most recent call first, to stderr in
    one write, each under a header as faulthandler's (``Thread 0x...``)."""
    names = {t.ident: t.name for t in threading.enumerate()}
    frames = {ident: frame for ident, frame in sys._current_frames().items() if ident != leave_out}
    parts = [f"[rank {os.environ.get('RANK', '0')}] {why}: the stacks of this process's {len(frames)} "
             f"thread(s){' besides the one printing them' if leave_out is not None else ''}, most recent call "
             f"first; training goes on\n"]
    for ident, frame in frames.items():
        parts.append(f"Thread 0x{ident:016x} ({names.get(ident, '?')}; most recent call first):\n")
        while frame is not None:  # no source lines read: a stuck file system must not hold the dump
            parts.append(f'  File "{frame.f_code.co_filename}", line {frame.f_lineno} in {frame.f_code.co_name}\n')
            frame = frame.f_back
    os.write(sys.stderr.fileno(), "".join(parts).encode(errors="replace"))


def _quiet_in_child() -> None:
    # A forked helper (a checkpoint writer) must not wake its parent's watcher through the shared
    # socket. Its SIGTERM disposition is child_processes' business (it outlives the group's SIGTERM).
    # It has no watcher: its main thread prints its stacks.
    signal.set_wakeup_fd(-1)
    signal.signal(signal.SIGQUIT, lambda signum, frame: print_stacks("SIGQUIT (a forked helper)"))


def _say(message: str) -> None:
    rank = os.environ.get("RANK", "0")
    print(f"[rank {rank}] {message}", file=sys.stderr, flush=True)


class StopCheck:
    """Megatron-LM's --exit-signal-handler and --exit-duration-in-mins: after each iteration, one
    all-reduce tells every rank whether any got SIGTERM or the time is up, so all stop together."""

    def __init__(self, watcher: SigtermWatcher, exit_duration_min: Optional[float], started: float):
        self.watcher = watcher
        self.deadline = None if exit_duration_min is None else started + 60.0 * exit_duration_min
        self.enabled = watcher.save_on_signal or self.deadline is not None

    def after_iteration(self, seconds: float, device) -> Optional[str]:
        """Why to stop now (the same answer on every rank), or None."""
        self.watcher.iteration_done(seconds)
        if not self.enabled:
            return None
        flags = torch.tensor([float(self.watcher.requested.is_set()),
                              float(self.deadline is not None and time.time() > self.deadline)], device=device)
        torch.distributed.all_reduce(flags, op=torch.distributed.ReduceOp.MAX)
        signalled, timed_out = (bool(x) for x in flags.tolist())
        if signalled or timed_out:
            self.watcher.acknowledged.set()
        if signalled:
            return f"receiving {self.watcher.save_on.name} (--exit-signal-handler)"
        if timed_out:
            return "reaching --exit-duration-in-mins"
        return None
