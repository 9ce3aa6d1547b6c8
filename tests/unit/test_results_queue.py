"""The checkpoint writers' results queue (megatron/training/runtime/results_queue.py): results go
through it unchanged, an empty queue raises queue.Empty as megatron-core expects, and its spawned
server never loads torch, whatever the results hold (a plain Manager queue's server imports torch
to unpickle them: ~250 MB and 3 s of CPU per rank at the first save)."""

import multiprocessing
import os
import queue
import subprocess
import sys

import pytest
import torch
from torch.distributed.checkpoint.metadata import MetadataIndex
from torch.distributed.checkpoint.storage import WriteResult

from megatron.training.runtime.die_with_parent import main_module_left_out
from megatron.training.runtime.results_queue import ResultsManager


def _loaded_libraries(pid: int) -> str:
    with open(f"/proc/{pid}/maps") as maps:
        return maps.read()


@pytest.fixture(scope="module")
def manager():
    manager = ResultsManager(ctx=multiprocessing.get_context("spawn"))
    with main_module_left_out():
        manager.start()
    yield manager
    manager.shutdown()


def test_results_pass_unchanged_and_the_server_never_loads_torch(manager):
    results_queue = manager.PickledQueue()
    results = {0: [WriteResult(index=MetadataIndex("decoder.weight", (0, 4)), size_in_bytes=4096,
                               storage_data={"relative_path": "__0_0.distcp", "offset": 0, "length": 4096})],
               1: [RuntimeError("a writer failed")]}
    results_queue.put(results)
    results_queue.put(torch.arange(3))
    got = results_queue.get_nowait()
    assert got.keys() == results.keys() and got[0] == results[0]
    assert isinstance(got[1][0], RuntimeError) and str(got[1][0]) == "a writer failed"
    assert torch.equal(results_queue.get_nowait(), torch.arange(3))
    with pytest.raises(queue.Empty):
        results_queue.get_nowait()
    assert "libtorch" in _loaded_libraries(multiprocessing.current_process().pid)  # the check can fail
    assert "libtorch" not in _loaded_libraries(manager.server_pid)


def test_a_forked_writer_reaches_the_rank_through_it(manager):
    """megatron-core's writers and async caller are forked from the rank and put into the queue."""
    results_queue = manager.PickledQueue()
    child = multiprocessing.get_context("fork").Process(target=results_queue.put, args=({"written": 3},))
    child.start()
    child.join(30)
    assert child.exitcode == 0 and results_queue.get_nowait() == {"written": 3}


START_AND_USE = """
import multiprocessing
from megatron.training.runtime.die_with_parent import main_module_left_out
from megatron.training.runtime.results_queue import ResultsManager
manager = ResultsManager(ctx=multiprocessing.get_context("spawn"))
with main_module_left_out():
    manager.start()
results_queue = manager.PickledQueue()
results_queue.put({"written": 1})
print(results_queue.get_nowait())
manager.shutdown()
"""


def test_a_temporary_directory_too_long_for_a_socket_path_does_not_stop_it(tmp_path):
    """A job whose TMPDIR is long (a node-local scratch nested deep): a socket file under it would pass the
    107 bytes Linux allows an AF_UNIX path, and the server would die at start-up (the rank saw only an
    EOFError). The server listens where no file is needed. Run in a fresh process, as at a rank's start-up: a
    process that has made its multiprocessing temporary directory already hands that one to the server."""
    long_dir = tmp_path / ("d" * 60) / ("e" * 60)
    long_dir.mkdir(parents=True)
    assert len(str(long_dir)) > 108  # no socket file fits under it
    done = subprocess.run([sys.executable, "-c", START_AND_USE], env={**os.environ, "TMPDIR": str(long_dir)},
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.strip() == "{'written': 1}"
