"""--async-save hands megatron-core a function to fork for its torch_dist writer: wrapped, the child puts itself
(and what it starts) in the idle I/O class and at nice 19 (megatron/training/runtime/io_priority.py); the rank stays
as it was."""

import multiprocessing
import os

import pytest

from megatron.training.runtime import io_priority


def _report_class(queue):
    queue.put(io_priority.io_priority_class())


def _report_nice(queue):
    queue.put(os.getpriority(os.PRIO_PROCESS, 0))


@pytest.mark.skipif(io_priority.io_priority_class() < 0, reason="no ioprio_get here (Linux only)")
def test_a_forked_writer_runs_in_the_idle_io_class():
    context = multiprocessing.get_context("fork")
    queue = context.Queue()
    child = context.Process(target=io_priority.at_idle_priority(_report_class), args=(queue,))
    child.start()
    child.join()
    assert queue.get(timeout=10) == io_priority.IOPRIO_CLASS_IDLE
    assert io_priority.io_priority_class() != io_priority.IOPRIO_CLASS_IDLE
    assert io_priority.describe(os.getcwd())  # a line whatever the device


def test_the_line_says_whether_the_scheduler_honours_it(monkeypatch):
    for scheduler, verdict in (("none", "NOT honoured"), ("bfq", "honoured by"), (None, "may not be honoured")):
        monkeypatch.setattr(io_priority, "scheduler_of", lambda path, s=scheduler: s)
        assert verdict in io_priority.describe("/")


def test_a_forked_writer_runs_at_the_lowest_cpu_priority():
    context = multiprocessing.get_context("fork")
    queue = context.Queue()
    before = os.getpriority(os.PRIO_PROCESS, 0)
    if before == io_priority.LOWEST_NICE:
        pytest.skip("this test already runs at nice 19: the child's would show nothing")
    child = context.Process(target=io_priority.at_idle_priority(_report_nice), args=(queue,))
    child.start()
    child.join()
    assert queue.get(timeout=10) == io_priority.LOWEST_NICE
    assert os.getpriority(os.PRIO_PROCESS, 0) == before  # the rank's own priority untouched
