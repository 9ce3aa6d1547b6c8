"""The engine's param-high source: the model's bf16 params, which complete the fp32 masters it
stores as 16-bit remainders (``mlp_offload.kernels.remainders``), read from the DDP param buffers' shard.

The device update reads them on the device (``to_device``: a copy on the engine's compute stream);
the CPU update gets a host copy (``fill``). On a CPU run both are plain copies (the CPU twin).
"""

from __future__ import annotations

import torch

from megatron.training.offload.shard_layout import ShardLayout


class ModelParamHigh:
    def __init__(self, layout: ShardLayout, copy_stream=None):
        self.layout = layout
        self.copy_stream = copy_stream  # CUDA: the shard's copy stream, where params go back up too

    def fill(self, start: int, end: int, out: torch.Tensor) -> None:
        if self.copy_stream is None:
            self.to_device(start, end, out)
            return
        # CUDA: on the copy stream, after the params copied back to this range before (same stream).
        with torch.cuda.stream(self.copy_stream):
            self.to_device(start, end, out, non_blocking=True)
        self.copy_stream.synchronize()

    def to_device(self, start: int, end: int, out: torch.Tensor, non_blocking: bool = True) -> None:
        # (On the update's stream: from pinned host memory the host need not wait. The only writer of a range,
        # its copy back after its update, is ordered after this read on the device.)
        for lo, hi, view in self.layout.views(start, end, "param"):
            out[lo - start: hi - start].copy_(view, non_blocking=non_blocking)


class ModelParamHighInPlace(ModelParamHigh):
    """The same, with ``views``: where the update's device holds the params, it writes them there in place
    (not with --offload-params host on a GPU: a CUDA kernel cannot write host memory)."""

    def views(self, start: int, end: int):
        """The params of [start, end) in the DDP buffers."""
        return self.layout.views(start, end, "param")
