"""A rank's child processes die with it when it is SIGKILLed (megatron.training.runtime.child_processes).

A stand-in rank does what a rank's first checkpoint save does: gets megatron-core's write-results
queue (a spawned Manager, and with it the resource tracker) and forks a writer, which here sleeps
as a writer stuck on its queue would; then it SIGKILLs itself. run_and_clean_up fails if any of
its processes is still alive 2 s later.
"""

import os
import sys
import textwrap

import pytest

from launch import REPO, run_and_clean_up

RANK = textwrap.dedent("""
    import multiprocessing, os, signal, sys, time
    from multiprocessing import util

    from megatron.core.dist_checkpointing.strategies import filesystem_async
    from megatron.training.runtime import child_processes

    if sys.argv[1] == "late":  # the writer is slow to start: its parent is dead before it can set PDEATHSIG
        util.register_after_fork(time, lambda _: time.sleep(1))
    child_processes.die_with_rank(start_results_queue=True)
    filesystem_async._get_write_results_queue()
    multiprocessing.get_context("fork").Process(target=time.sleep, args=(600,)).start()
    print("children:", len(multiprocessing.active_children()), flush=True)
    os.kill(os.getpid(), signal.SIGKILL)
""")


@pytest.mark.parametrize("writer", ["prompt", "late"])
def test_children_die_with_a_killed_rank(tmp_path, writer):
    env = {**os.environ, "PYTHONPATH": str(REPO), "PYTHONWARNINGS": "ignore"}
    returncode, output = run_and_clean_up([sys.executable, "-c", RANK, writer], env, 120, tmp_path / "rank.out")
    assert returncode == -9 and "children: 2" in output, output
