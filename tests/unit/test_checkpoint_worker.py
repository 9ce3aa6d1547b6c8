"""--use-persistent-ckpt-worker's worker (megatron.training.runtime.checkpoint_worker): forked once, it runs each
save's write from the staging the rank copied the tensors into. The references are the tensors as they were at the
submit (cloned by the test) and torch.save's own files of them."""

import os
import signal
import time
from dataclasses import dataclass

import pytest
import torch
from hypothesis import given, settings, strategies as st
from megatron.core.dist_checkpointing.strategies.async_utils import AsyncRequest

from megatron.training.runtime.checkpoint_worker import (ALIGN, SharedStaging, StandingCaller, StandingWorker,
                                                          bucket_tensors, staged_bytes, unstaged)
from mlp_offload.checkpoint import FlushPacing

DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.int64, torch.uint8]


def buckets_of(directory, tensors_per_file):
    """megatron-core's write buckets: (path, storage key, (bytes items, tensor items)) per file."""
    return [(os.path.join(directory, f"{i}.distcp"), f"key{i}", ([], [(f"item{i}.{j}", t) for j, t in enumerate(ts)]))
            for i, ts in enumerate(tensors_per_file)]


def save_each_file(rank, buckets, queue):
    """A stand-in for megatron-core's write: each bucket's tensors, with its storage's size, by torch.save."""
    for path, _, (_, items) in buckets:
        torch.save([(t, t.untyped_storage().nbytes()) for _, t in items], path)


def fail_to_write(rank, buckets, queue):
    raise OSError(28, "No space left on device\nat the second file")


@dataclass(frozen=True)
class WaitsForFile:
    """A write that lasts until ``release`` exists (at most 20 s), carrying the flush pacing as megatron-core's
    write does in async_save.BackgroundWrite."""
    release: str
    flush: FlushPacing

    def __call__(self, rank, buckets, queue):
        deadline = time.monotonic() + 20
        while not os.path.exists(self.release) and time.monotonic() < deadline:
            time.sleep(0.01)


@pytest.fixture
def worker():
    worker = StandingWorker.start(pin=False)
    yield worker
    worker.close()


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def test_the_write_holds_the_values_at_the_submit_and_the_rank_forks_nothing(worker, tmp_path, monkeypatch):
    monkeypatch.setattr(os, "fork", lambda: pytest.fail("a save forked the rank"))
    tensors = [[torch.randn(1000), torch.arange(7, dtype=torch.int64)], [torch.randn(3, 5).bfloat16()]]
    at_submit = [[t.clone() for t in ts] for ts in tensors]
    worker.submit(1, save_each_file, [0, buckets_of(str(tmp_path), tensors), None], {}, None)
    for t in bucket_tensors(buckets_of(str(tmp_path), tensors)):
        t.fill_(-1)  # the next step changes the state while the worker writes
    assert worker.result(1, wait=True) == (True, None)
    for i, expected in enumerate(at_submit):
        written = torch.load(tmp_path / f"{i}.distcp")
        for (tensor, storage_bytes), reference in zip(written, expected):
            assert torch.equal(tensor, reference)
            assert storage_bytes == reference.numel() * reference.element_size()  # not the whole staging


def test_a_failed_write_is_told_in_one_line_and_the_worker_goes_on(worker, tmp_path):
    worker.submit(1, fail_to_write, [0, buckets_of(str(tmp_path), [[torch.ones(4)]]), None], {}, None)
    ended, failure = worker.result(1, wait=True)
    assert ended and failure == "OSError: [Errno 28] No space left on device at the second file"
    worker.submit(2, save_each_file, [0, buckets_of(str(tmp_path), [[torch.ones(4)]]), None], {}, None)
    assert worker.result(2, wait=True) == (True, None)


def test_the_staging_grows_for_a_larger_save_and_the_worker_maps_it_again(worker, tmp_path):
    worker.reserve(staged_bytes([(10, torch.float32)]))
    assert worker.staging.size == ALIGN
    for call, numel in enumerate((10, 5000, 100), start=1):
        values = torch.randn(numel)
        worker.submit(call, save_each_file, [0, buckets_of(str(tmp_path), [[values]]), None], {}, None)
        assert worker.result(call, wait=True) == (True, None)
        assert torch.equal(torch.load(tmp_path / "0.distcp")[0][0], values)
    assert worker.staging.size == staged_bytes([(5000, torch.float32)])  # grown once, never shrunk


def test_the_flush_pacings_running_lock_is_held_while_the_worker_writes(worker, tmp_path):
    pacing = FlushPacing(("nvme",), (), None, 1e9, running_path=str(tmp_path / "RUNNING"))
    caller = StandingCaller(worker)
    write = WaitsForFile(str(tmp_path / "release"), pacing)
    caller.schedule_async_call(AsyncRequest(write, (0, buckets_of(str(tmp_path), [[torch.ones(3)]]), None), [],
                                            call_idx=5))
    assert not caller.is_current_async_call_done(no_dist=True)
    assert pacing.writer_running()  # the rank's copy of the lock was closed: only the worker's holds it
    (tmp_path / "release").touch()
    assert caller.is_current_async_call_done(blocking=True, no_dist=True)
    assert caller.failure is None and not pacing.writer_running()
    assert caller.is_current_async_call_done(no_dist=True)  # asked again: still done


def test_the_worker_ends_at_close_and_at_kill(tmp_path):
    closed = StandingWorker.start(pin=False)
    closed.submit(1, save_each_file, [0, buckets_of(str(tmp_path), [[torch.ones(2)]]), None], {}, None)
    closed.close()  # after the write it has
    assert not alive(closed.pid) and (tmp_path / "0.distcp").exists()
    killed = StandingWorker.start(pin=False)
    write = WaitsForFile(str(tmp_path / "never"), FlushPacing((), (), None, 1e9))
    killed.submit(1, write, [0, buckets_of(str(tmp_path), [[torch.ones(2)]]), None], {}, None)
    killed.kill()
    assert not alive(killed.pid)
    ended, failure = killed.result(1, wait=True)
    assert ended and failure == f"the checkpoint worker (pid {killed.pid}) ended before the write did"


def test_the_worker_ignores_an_interrupt_to_the_job(worker, tmp_path):
    os.kill(worker.pid, signal.SIGINT)  # ^C reaches every process of the job; the rank decides what happens
    worker.submit(1, save_each_file, [0, buckets_of(str(tmp_path), [[torch.ones(2)]]), None], {}, None)
    assert worker.result(1, wait=True) == (True, None)


tensor_shapes = st.lists(st.tuples(st.sampled_from(DTYPES), st.lists(st.integers(0, 9), max_size=3)),
                         min_size=1, max_size=6)


@settings(max_examples=40, deadline=None)
@given(files=st.lists(tensor_shapes, min_size=1, max_size=3))
def test_staging_round_trip_keeps_every_tensor_on_its_own_pages(files):
    tensors = [[(torch.rand(shape) * 100).to(dtype) for dtype, shape in ts] for ts in files]
    staging = SharedStaging(pin=False)
    try:
        staged = staging.stage(buckets_of("/nowhere", tensors))
        places = [p for _, _, (_, items) in staged for _, p in items]
        spans = sorted((p.offset, p.offset + p.nbytes) for p in places)
        assert all(start % ALIGN == 0 for start, _ in spans)
        assert all(end <= next_start for (_, end), (next_start, _) in zip(spans, spans[1:]))
        assert staging.size == staged_bytes((t.numel(), t.dtype) for ts in tensors for t in ts)
        rebuilt = unstaged(staged, staging.mapping)
        for original, copy in zip(bucket_tensors(buckets_of("/nowhere", tensors)), bucket_tensors(rebuilt)):
            assert copy.dtype == original.dtype and torch.equal(copy, original)
            assert copy.untyped_storage().nbytes() == original.numel() * original.element_size()
        del rebuilt, copy
    finally:
        staging.close()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the pinned staging needs CUDA")
def test_cuda_tensors_are_staged_through_pinned_memory(tmp_path):
    worker = StandingWorker.start(pin=True)
    try:
        values = torch.randn(1 << 20, device="cuda")
        at_submit = values.cpu()
        worker.submit(1, save_each_file, [0, buckets_of(str(tmp_path), [[values]]), None], {}, None)
        values.zero_()
        assert worker.result(1, wait=True) == (True, None)
        assert torch.equal(torch.load(tmp_path / "0.distcp")[0][0], at_submit)
        assert worker.staging.flat.is_pinned()  # registered with CUDA: the device's copy ran at the link's pace
    finally:
        worker.close()
