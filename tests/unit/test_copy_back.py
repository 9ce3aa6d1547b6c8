"""CopyBack (megatron/training/offload/copy_back.py): the device-updated params' copy back into host memory
beside the next piece's update. Each piece lands whole in its host views even though the caller overwrites its
source at once (two staging buffers, reused in turn only after their copy out). On the CPU (the twin) and on a
GPU where there is one (the GPU suite's CUDA unit tests)."""

import pytest
import torch

from megatron.training.offload.copy_back import CopyBack

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_each_piece_lands_whole_though_its_source_is_reused_at_once(device, dtype):
    stream = torch.cuda.Stream() if device == "cuda" else None
    back = CopyBack(stream)
    numel, pieces = 1 << 22, 5  # large enough that a copy still running would be overwritten on the GPU
    host = torch.zeros(pieces * numel, dtype=dtype)
    if device == "cuda":
        host = host.pin_memory()
    source = torch.empty(numel, dtype=dtype, device=device)  # one buffer, as the update reuses its own
    expected = []
    for k in range(pieces):
        source.fill_(k + 1)
        source[:: 7] = -(k + 1)  # not one value throughout
        expected.append(source.cpu().clone())
        at = k * numel
        # the piece split over three host views, as a range of the shard spans several params
        cuts = [0, numel // 3, numel // 2, numel]
        back.put(source, [(host[at + lo: at + hi], lo, hi) for lo, hi in zip(cuts, cuts[1:])])
        source.fill_(-99)  # the update's next piece, at once
    back.wait()
    for k in range(pieces):
        assert torch.equal(host[k * numel: (k + 1) * numel], expected[k]), k


@pytest.mark.parametrize("device", DEVICES)
def test_a_larger_piece_after_a_smaller_one_gets_staging_of_its_size(device):
    stream = torch.cuda.Stream() if device == "cuda" else None
    back = CopyBack(stream)
    host = torch.zeros(30)
    for size in (4, 10, 30, 3):
        source = torch.arange(size, dtype=torch.float32, device=device) + size
        back.put(source, [(host[:size], 0, size)])
        back.wait()
        assert torch.equal(host[:size], source.cpu())
