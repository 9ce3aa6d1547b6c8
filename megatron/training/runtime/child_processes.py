"""No child process of a rank outlives it, however the rank dies (SIGKILL, OOM killer).

A rank's checkpoint saves start processes (megatron-core 0.16.1, ``dist_checkpointing``):

- a multiprocessing Manager server (spawn) that holds the write-results queue; megatron-core
  starts it lazily on the first save (``filesystem_async._get_write_results_queue``) and it lives
  as long as the rank. Started here instead, without importing the rank's ``__main__``
  (``die_with_parent.main_module_left_out``), and serving a queue whose results stay pickled
  (``results_queue``): it never imports torch, neither at start-up (pretrain_gpt.py imports it) nor at
  the first save (unpickling the results imports it), so it costs a fraction of the memory and CPU time
  (docs/design.md, "Signals and errors");
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

import multiprocessing
import sys
import threading
import warnings
from multiprocessing import util

from megatron.training.runtime import core_private
from megatron.training.runtime.die_with_parent import die_with_parent, main_module_left_out
from megatron.training.runtime.results_queue import ResultsManager


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
    util.register_after_fork(die_with_parent, die_with_parent)  # the function itself is the (never freed) key
    if start_results_queue and not core_private.checkpoint_results_queue_started():
        manager = ResultsManager(ctx=multiprocessing.get_context("spawn"))  # the context megatron-core uses
        with main_module_left_out():
            manager.start(die_with_parent)
        # megatron-core would start its own on the first save, with no initializer, from whatever
        # thread saves. The queue proxy keeps the manager alive.
        core_private.set_checkpoint_results_queue(manager.PickledQueue())
