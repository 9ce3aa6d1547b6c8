"""--async-save's host memory: what a save copies to host is pinned at start-up, so the first background
save's copy reuses torch's cached pinned blocks instead of pinning while training waits.

The selection is checked on the CPU (on meta tensors standing for GPU ones); the reuse needs CUDA and
is read from torch's own counter of pinned blocks it had to create (``torch.cuda.host_memory_stats``)."""

import pytest
import torch
from megatron.core.dist_checkpointing.mapping import ShardedTensor, ShardedTensorFactory, apply_factories
from megatron.core.dist_checkpointing.dict_utils import nested_values

from megatron.training.checkpoint import async_save
from megatron.training.checkpoint.async_save import copied_tensor_sizes, reserve_host_copies


def _halves(key, data, replica_id, flattened_range):
    """As SwiGLU's fc1 is saved: its two halves, each a tensor of its own."""
    gate, up = torch.chunk(data, 2, dim=0)
    return {"gate": ShardedTensor.from_rank_offsets(f"{key}.gate", gate, replica_id=replica_id),
            "up": ShardedTensor.from_rank_offsets(f"{key}.up", up, replica_id=replica_id)}


def _model_state(device):
    """A model's sharded state dict in little: a weight, a replicated one another rank writes, a factory."""
    weight = torch.zeros(96, 40, dtype=torch.bfloat16, device=device)
    norm = torch.zeros(40, dtype=torch.float32, device=device)
    fc1 = torch.zeros(64, 40, dtype=torch.bfloat16, device=device)
    return {"layer": {"weight": ShardedTensor.from_rank_offsets("weight", weight, replica_id=0),
                      "norm": ShardedTensor.from_rank_offsets("norm", norm, replica_id=1),
                      "fc1": ShardedTensorFactory("fc1", fc1, _halves, lambda parts: None, replica_id=0)}}


@pytest.mark.parametrize("fully_parallel", [False, True])
def test_the_sizes_are_those_the_save_copies(monkeypatch, fully_parallel):
    monkeypatch.setattr(torch.Tensor, "is_cuda", property(lambda t: t.device.type == "meta"))  # meta stands for GPU
    sizes = copied_tensor_sizes(_model_state("meta"), fully_parallel)
    expected = [(96 * 40, torch.bfloat16), (32 * 40, torch.bfloat16), (32 * 40, torch.bfloat16)]
    if fully_parallel:  # the writer of a replicated tensor is picked at the save: this rank may be it
        expected.insert(1, (40, torch.float32))
    assert sorted(sizes, key=str) == sorted(expected, key=str)
    assert copied_tensor_sizes(_model_state("cpu"), fully_parallel) == []  # CPU tensors: nothing to pin


def test_nothing_is_pinned_without_cuda(monkeypatch):
    monkeypatch.setattr(torch.Tensor, "is_cuda", property(lambda t: t.device.type == "meta"))
    monkeypatch.setattr(async_save.torch.cuda, "is_available", lambda: False)
    assert copied_tensor_sizes(_model_state("meta"), False)  # there would be something to pin
    assert reserve_host_copies(_model_state("meta"), False) == (0, 0.0)


def test_host_memory_too_short_to_pin_stops_in_one_line(monkeypatch):
    """Pinning fails as torch fails it where host memory is short: one line naming the flag, the size and a way
    out, nothing of torch's traceback."""
    from megatron.training.errors import UserError

    monkeypatch.setattr(torch.Tensor, "is_cuda", property(lambda t: t.device.type == "meta"))
    monkeypatch.setattr(async_save.torch.cuda, "is_available", lambda: True)
    real_empty = torch.empty

    def empty(*args, pin_memory=False, **kwargs):
        if pin_memory:
            raise RuntimeError("CUDA error: out of memory\nCUDA kernel errors might be asynchronously reported")
        return real_empty(*args, **kwargs)

    monkeypatch.setattr(async_save.torch, "empty", empty)
    with pytest.raises(UserError) as caught:
        reserve_host_copies(_model_state("meta"), False)
    line = str(caught.value)
    assert "\n" not in line and caught.value.__cause__ is None and caught.value.__suppress_context__
    assert line.startswith("--async-save: pinning 0.01 MB of host memory") and "(CUDA error: out of memory)" in line
    assert "a smaller budget of the host tier" in line


@pytest.mark.skipif(not torch.cuda.is_available(), reason="pinned host memory needs CUDA")
def test_the_first_copy_to_host_creates_no_pinned_block():
    def copies(state):  # what megatron-core's preload does with each tensor it saves
        apply_factories(state)
        tensors = [v.data for v in nested_values(state) if isinstance(v, ShardedTensor) and v.replica_id == 0]
        copied = [t.to("cpu", non_blocking=True) for t in tensors]
        torch.cuda.synchronize()
        return copied

    def blocks_created():
        return torch.cuda.host_memory_stats()["num_host_alloc"]

    nbytes, _ = reserve_host_copies(_model_state("cuda"), False)
    assert nbytes >= (96 * 40 + 64 * 40) * 2
    reserved = blocks_created()
    first = copies(_model_state("cuda"))  # as the first save's preload
    assert blocks_created() == reserved, "the first save's copy pinned new host memory"
    second = copies(_model_state("cuda"))  # while the first's blocks are in use: the counter sees new ones
    assert blocks_created() > reserved and len(first) == len(second) == 3
