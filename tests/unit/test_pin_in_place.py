"""Params in host memory pinned in place (runtime/host_memory.py): DDP's param buffer is zeros that take the
node's memory only as the params are copied in (each old copy freed after it), then page-locked where they lie,
so a model's params are never in host memory twice at start-up. CPU: the zeros and their lazy commit; CUDA (the
GPU suite's unit tests): the buffer pinned, and copies to the GPU from it."""

import pytest
import torch

from megatron.training.runtime.host_memory import host_zeros_to_pin, pin_in_place


def unpin(tensor: torch.Tensor) -> None:
    """Undo ``pin_in_place`` before the test frees ``tensor`` (the product's buffers live as long as their
    process): a range freed registered stays known to CUDA as pinned, and a buffer mapped there later is then
    taken for pinned memory its copies never reach."""
    torch.cuda.synchronize()  # no copy may still read or write it
    torch.cuda.cudart().cudaHostUnregister(tensor.data_ptr())


def _resident_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4096


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_the_buffer_is_zeros_and_takes_memory_only_where_written(dtype):
    numel = 256 * 2**20 // torch.empty(0, dtype=dtype).element_size()  # 256 MiB
    before = _resident_bytes()
    buffer = host_zeros_to_pin(numel, dtype)
    assert buffer.dtype == dtype and buffer.numel() == numel and buffer.device.type == "cpu"
    assert _resident_bytes() - before < 64 * 2**20  # nothing committed yet
    buffer[: numel // 2].fill_(1)
    grown = _resident_bytes() - before
    assert 100 * 2**20 < grown < 200 * 2**20  # half of it, as it was written
    assert int(torch.count_nonzero(buffer[numel // 2:])) == 0


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA")
def test_pinned_in_place_it_copies_to_the_gpu_without_holding_the_host():
    buffer = host_zeros_to_pin(1 << 24, torch.bfloat16)
    buffer.copy_(torch.arange(1 << 24, dtype=torch.float32).to(torch.bfloat16))
    expected = buffer.clone()
    pin_in_place(buffer, "test")
    try:
        assert buffer.is_pinned() and torch.equal(buffer, expected)  # the contents stay where they were
        on_gpu = buffer.to("cuda", non_blocking=True)
        torch.cuda.synchronize()
        assert torch.equal(on_gpu.cpu(), expected)
    finally:
        unpin(buffer)  # freed registered, its range would pass for pinned in the tests after this one
    assert not buffer.is_pinned()
