"""--async-save with the params in host memory: the weights a save writes out of DDP's host buffers are copied
aside at the save (async_save.HostWeightsAside), so the writer, run after the buffers have changed in place (as
the next updates change them), still writes the weights as they were at the save.

The writer runs here in this process (it then sees the buffers as they are when it runs) or forked, as training
runs it, from three kinds of buffer: the CPU twin's (ordinary memory: the fork keeps it as it was), a GPU run's
without the pinning (memory left out of forked children, ``MADV_DONTFORK``: the child reads whatever its own
memory holds at that address) and, with CUDA, a GPU run's as it is (pinned in place). megatron-core's plan
clones a CPU tensor that is a view of a larger storage, but not one that fills its storage: the third weight
below is such a tensor, and without the copy aside the checkpoint holds its change, or, forked from a GPU run's
buffer, not its values at all (both checked, so the tests show they can fail)."""

import re
import time

import pytest
import torch
from megatron.core import dist_checkpointing
from megatron.core.dist_checkpointing.mapping import ShardedTensor
from megatron.core.dist_checkpointing.strategies.async_utils import AsyncCallsQueue
from megatron.core.dist_checkpointing.strategies.torch import TorchDistSaveShardedStrategy

from tests.unit.helpers import megatron_world_of_one
from megatron.training.checkpoint import async_save
from megatron.training.checkpoint.async_save import HostWeightsAside
from megatron.training.errors import UserError
from megatron.training.runtime.host_memory import host_zeros_to_pin, pin_in_place


@pytest.fixture(scope="module", autouse=True)
def world():
    yield from megatron_world_of_one()


@pytest.fixture(autouse=True)
def no_device(monkeypatch):
    """The writer's preload waits for the device's copies to host, its finalize all-reduces on the current
    device: a CPU run's answers (cpu_compat gives them in a run)."""
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *args: None)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: torch.device("cpu"))


BUFFERS = ["ordinary", "unforked"] + (["pinned"] if torch.cuda.is_available() else [])  # pinning needs CUDA


def _host_buffers(kind: str = "ordinary"):
    """Two of DDP's param buffers in host memory: one holding two weights, one holding exactly one. ``kind``:
    ordinary memory (the CPU twin's), memory left out of forked children (a GPU run's, host_zeros_to_pin), or
    that pinned in place as a GPU run pins it."""
    values = torch.arange(96, dtype=torch.bfloat16), torch.arange(100, 132, dtype=torch.bfloat16)
    if kind == "ordinary":
        return values
    buffers = tuple(host_zeros_to_pin(v.numel(), v.dtype) for v in values)
    for buffer, value in zip(buffers, values):
        buffer.copy_(value)
        if kind == "pinned":
            pin_in_place(buffer, "the test's host buffer")
    return buffers


def _state(shared, alone, outside):
    """The model's sharded state: two weights in the first buffer (views), the second buffer's only weight, a
    replica another rank writes, and a tensor outside the buffers (left as it is)."""
    return {"a": ShardedTensor.from_rank_offsets("a", shared[:64].view(8, 8), replica_id=0),
            "b": ShardedTensor.from_rank_offsets("b", shared[64:].view(4, 8), replica_id=0),
            "c": ShardedTensor.from_rank_offsets("c", alone.view(4, 8), replica_id=0),
            "d": ShardedTensor.from_rank_offsets("d", shared[:32], replica_id=1),
            "e": ShardedTensor.from_rank_offsets("e", outside, replica_id=0)}


def _save_then_change(tmp_path, copy_aside: bool, forked: bool = False, kind: str = "ordinary"):
    """An async save's request, the buffers changed in place, then the request's writer run (here, or
    ``forked`` as training runs it, the change made while the writer waits); returns the checkpoint's
    tensors and what the buffers held at the save."""
    shared, alone = _host_buffers(kind)
    at_save = {"a": shared[:64].view(8, 8).clone(), "b": shared[64:].view(4, 8).clone(), "c": alone.view(4, 8).clone()}
    strategy = TorchDistSaveShardedStrategy("torch_dist", 1, thread_count=1)
    if copy_aside:
        strategy = HostWeightsAside([shared, alone]).wrapping(strategy)
    request = dist_checkpointing.save(_state(shared, alone, torch.ones(16)), str(tmp_path), sharded_strategy=strategy,
                                      async_sharded_save=True, validate_access_integrity=False)
    if forked:
        queue = AsyncCallsQueue(persistent=False)
        queue.schedule_async_request(request._replace(async_fn=_after_a_while(request.async_fn)))
    shared.add_(1000)  # the next update writes the params in place
    alone.add_(1000)
    if forked:
        queue.maybe_finalize_async_calls(blocking=True)
    else:
        request.execute_sync()
    template = {name: ShardedTensor.from_rank_offsets(name, torch.empty_like(t), replica_id=0)
                for name, t in at_save.items()}
    return dist_checkpointing.load(template, str(tmp_path)), at_save


def _after_a_while(write):
    """The writer, started a moment late: the change in place comes first."""

    def later(*args, **kwargs):
        time.sleep(0.5)
        return write(*args, **kwargs)
    return later


def test_the_writer_writes_the_weights_as_they_were_at_the_save(tmp_path):
    loaded, at_save = _save_then_change(tmp_path, copy_aside=True)
    for name, tensor in at_save.items():
        assert torch.equal(loaded[name], tensor), name


def test_without_the_copy_a_weight_filling_its_buffer_is_read_live(tmp_path):
    """The reason for the copy: megatron-core leaves a CPU tensor that fills its storage where it lies."""
    loaded, at_save = _save_then_change(tmp_path, copy_aside=False)
    assert torch.equal(loaded["a"], at_save["a"]) and torch.equal(loaded["b"], at_save["b"])  # cloned by its plan
    assert torch.equal(loaded["c"], at_save["c"] + 1000)  # read where it lies, after the change


def test_only_what_this_rank_writes_is_copied_once(tmp_path):
    """The main replicas in the buffers, each into a tensor of its own, which the writer then takes as it is."""
    shared, alone = _host_buffers()
    outside = torch.ones(16)
    aside = HostWeightsAside([shared, alone])
    state = _state(shared, alone, outside)
    strategy = aside.wrapping(TorchDistSaveShardedStrategy("torch_dist", 1, thread_count=1))
    request = dist_checkpointing.save(state, str(tmp_path), sharded_strategy=strategy, async_sharded_save=True,
                                      validate_access_integrity=False)
    assert aside.copied_bytes == (64 + 32 + 32) * 2  # a, b and c in bf16; not d (another rank's), nor e
    copies = {name: state[name].data for name in "abc"}
    assert all(t.untyped_storage().nbytes() == t.numel() * t.element_size() for t in copies.values())
    written = {t.data_ptr() for _, _, (_, tensors) in request.async_fn_args[1] for _, t in tensors}
    assert {t.data_ptr() for t in copies.values()} <= written  # megatron-core copied them no second time
    assert state["e"].data.data_ptr() == outside.data_ptr()
    request.execute_sync()


def test_host_memory_too_short_for_the_copies_stops_the_save_in_one_line(tmp_path, monkeypatch):
    monkeypatch.setattr(async_save, "meminfo_bytes", lambda field: 100)  # bytes available
    shared, alone = _host_buffers()
    strategy = HostWeightsAside([shared, alone]).wrapping(TorchDistSaveShardedStrategy("torch_dist", 1))
    with pytest.raises(UserError) as raised:
        dist_checkpointing.save(_state(shared, alone, torch.ones(16)), str(tmp_path), sharded_strategy=strategy,
                                async_sharded_save=True, validate_access_integrity=False)
    line = str(raised.value)
    assert "\n" not in line and line.startswith("--async-save with --offload-params host: ")
    assert re.search(r"aside while the writer reads them, 0\.00 GiB on \S+ \(1 rank\(s\)\), but only 0\.00 GiB of "
                     r"host memory are available there; free host memory .* or save without --async-save$", line)


@pytest.mark.parametrize("kind", BUFFERS)
def test_a_forked_writer_writes_the_weights_as_they_were_at_the_save(tmp_path, kind):
    """As training runs it: megatron-core's forked writer, the buffers changed in place while it waits."""
    loaded, at_save = _save_then_change(tmp_path, copy_aside=True, forked=True, kind=kind)
    for name, tensor in at_save.items():
        assert torch.equal(loaded[name], tensor), name


def test_without_the_copy_a_forked_writer_misses_a_gpu_runs_weight_filling_its_buffer(tmp_path):
    """Why the copy on a GPU: the forked child has no such buffer, and writes what its memory holds there."""
    loaded, at_save = _save_then_change(tmp_path, copy_aside=False, forked=True, kind="unforked")
    assert torch.equal(loaded["a"], at_save["a"]) and torch.equal(loaded["b"], at_save["b"])  # cloned by its plan
    assert not torch.equal(loaded["c"], at_save["c"])
