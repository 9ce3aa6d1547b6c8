"""What a rank's helper process runs first so that it dies with the rank, and a way to spawn one
cheaply. Standard library only: the spawned helper (the checkpoint writers' results-queue Manager)
imports this module, and nothing heavier, to find the function."""

from __future__ import annotations

import contextlib
import ctypes
import multiprocessing
import os
import signal
import sys
import types

_PR_SET_PDEATHSIG = 1  # <linux/prctl.h>


def die_with_parent(*_unused, parent_pid: int = 0) -> None:
    """Run first in a multiprocessing child (Manager initializer; after-fork hook, which passes
    one argument), or in a plain fork given ``parent_pid``: the kernel SIGKILLs it when the thread
    that started it ends."""
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(_PR_SET_PDEATHSIG, int(signal.SIGKILL)) != 0:
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_PDEATHSIG) failed")
    # The parent may have died before prctl ran; then no signal will come.
    if os.getppid() != (parent_pid or multiprocessing.parent_process().pid):
        os.kill(os.getpid(), signal.SIGKILL)
    # torchrun stops a worker by SIGTERM to its whole process group, these children included; with
    # --exit-signal-handler the rank still saves after that, through them. They end with the rank
    # (the signal above) or when it stops them, never on their own account.
    signal.signal(signal.SIGTERM, signal.SIG_IGN)


@contextlib.contextmanager
def main_module_left_out():
    """While a process is spawned: a spawned child imports its parent's ``__main__`` first
    (``pretrain_gpt.py``, and torch with it) only to run a function that needs none of it: seconds
    of CPU and hundreds of MB per rank for a queue server (docs/design.md, "Signals and errors").
    Without a ``__main__`` file it imports just what the function's pickle names."""
    main = sys.modules["__main__"]
    sys.modules["__main__"] = types.ModuleType("__main__")
    try:
        yield
    finally:
        sys.modules["__main__"] = main
