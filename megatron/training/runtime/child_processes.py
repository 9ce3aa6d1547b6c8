"""No child process of a rank outlives it, however the rank dies (SIGKILL, OOM killer).

A rank's checkpoint saves start processes (megatron-core 0.16.1, ``dist_checkpointing``):

- a multiprocessing Manager server (spawn) that holds the write-results queue; megatron-core
  starts it lazily on the first save (``filesystem_async._get_write_results_queue``) and it lives
  as long as the rank;
- with it, the stdlib resource tracker (spawned with the first spawn-started child); it exits by
  itself once every holder of its pipe (the rank and all its children) is gone;
- per save, one forked writer per file (``write_preloaded_data_multiproc``, fork context).

- with --async-save, per save, the forked caller process that runs those writers in the background
  (async_save uses megatron-core's non-persistent caller; its persistent, spawned worker would not
  be covered).

A rank that exits normally stops them (the Manager at interpreter exit, the writers are joined).
A SIGKILLed rank runs nothing, so each child must notice on its own: ``die_with_rank`` makes the
kernel SIGKILL every such child when its parent dies (``PR_SET_PDEATHSIG``).
"""

from __future__ import annotations

import ctypes
import multiprocessing
import os
import signal
import sys
import threading
import warnings
from multiprocessing import util
from multiprocessing.managers import SyncManager

_PR_SET_PDEATHSIG = 1  # <linux/prctl.h>


def _die_with_parent(*_unused) -> None:
    """Run first in a multiprocessing child (Manager initializer; after-fork hook, which passes
    one argument): the kernel SIGKILLs it when the thread that started it ends."""
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(_PR_SET_PDEATHSIG, int(signal.SIGKILL)) != 0:
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_PDEATHSIG) failed")
    # The parent may have died before prctl ran; then no signal will come.
    if os.getppid() != multiprocessing.parent_process().pid:
        os.kill(os.getpid(), signal.SIGKILL)
    # torchrun stops a worker by SIGTERM to its whole process group, these children included; with
    # --exit-signal-handler the rank still saves after that, through them. They end with the rank
    # (the signal above) or when it stops them, never on their own account.
    signal.signal(signal.SIGTERM, signal.SIG_IGN)


def die_with_rank(start_results_queue: bool) -> None:
    """Make the checkpoint writer's child processes die with this rank; call it once, at start-up,
    from the main thread (PDEATHSIG fires when the *thread* that started a child ends).

    Every multiprocessing child this rank forks from now on gets PDEATHSIG (in training only
    dist_checkpointing's writers are forked, from the main thread; a child forked from another
    thread would die when that thread ends). With ``start_results_queue`` (the rank will save)
    the results-queue Manager is started here, from the main thread and with PDEATHSIG.
    """
    if not sys.platform.startswith("linux"):
        warnings.warn("PR_SET_PDEATHSIG is Linux-only: checkpoint writer processes may outlive a killed rank")
        return
    if threading.current_thread() is not threading.main_thread():
        raise RuntimeError("die_with_rank() must run in the main thread: its children die with the starting thread")
    util.register_after_fork(_die_with_parent, _die_with_parent)  # the function itself is the (never freed) key
    from megatron.core.dist_checkpointing.strategies import filesystem_async

    if start_results_queue and filesystem_async._results_queue is None:
        manager = SyncManager(ctx=multiprocessing.get_context("spawn"))  # the context megatron-core uses
        manager.start(_die_with_parent)
        # megatron-core would start its own on the first save, with no initializer, from whatever
        # thread saves. The queue proxy keeps the manager alive.
        filesystem_async._results_queue = manager.Queue()
