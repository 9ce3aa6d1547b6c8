"""The engine's gradient source on a GPU, and the fence it waits on for params copied back.

CUDA only: on a CPU run the facade copies grads and params itself (the CPU twin of this path).
"""

from __future__ import annotations

from typing import Dict

import torch

from megatron.training.offload.shard_layout import ShardLayout


class DeviceGradients:
    """The engine's gradient source on a GPU: per subgroup, cast the bf16/fp16 grad shard to fp32
    on the device (with the loss unscale and clip factors: fp32 multiplies round the same on GPU
    and CPU), then copy it into the engine's pinned scratch, on a side stream, so the copy of the
    next subgroup runs while the CPU does Adam on this one. The CPU does no conversion."""

    def __init__(self, layout: ShardLayout, stream, largest: int):
        self.layout = layout
        # With the update under the next forward, the training loop no longer zeroes the grad buffer
        # (it would race the update's reads): each range is zeroed here right after it was read.
        self.zero_after_read = False
        self.stream = stream
        # Two fp32 buffers for the CPU's subgroups, made when the CPU first gets one: where the split gives
        # the CPU nothing, their device memory stays the gpu tier's.
        self.largest = largest
        self.staging = None
        self.events: Dict[int, object] = {}
        self._turn = 0

    def start(self, start: int, end: int, out: torch.Tensor, unscale, clip_coef) -> None:
        if self.staging is None:
            with torch.cuda.stream(self.stream):
                self.staging = [torch.empty(self.largest, dtype=torch.float32, device=self.stream.device)
                                for _ in range(2)]
        buf = self.staging[self._turn % 2][: end - start]
        self._turn += 1
        with torch.cuda.stream(self.stream):
            for lo, hi, view in self.layout.views(start, end, "grad"):
                buf[lo - start: hi - start].copy_(view)
                if self.zero_after_read:
                    view.zero_()
            for factor in (unscale, clip_coef):
                if factor is not None and factor != 1.0:
                    buf.mul_(factor)
            out.copy_(buf, non_blocking=True)
            event = torch.cuda.Event()
            event.record(self.stream)
        self.events[start] = event

    def wait(self, start: int) -> None:
        self.events.pop(start).synchronize()

    def views(self, start: int, end: int):
        """The grads of [start, end) in the DDP buffers (the device update's one-pass kernel reads them there)."""
        return self.layout.views(start, end, "grad")

    def to_device(self, start: int, end: int, out: torch.Tensor, unscale, clip_coef) -> None:
        """For subgroups updated on the GPU: the same cast and multiplies into ``out`` on the
        current stream (the engine's compute stream); nothing crosses PCIe."""
        for lo, hi, view in self.layout.views(start, end, "grad"):
            out[lo - start: hi - start].copy_(view)
            if self.zero_after_read:
                view.zero_()
        for factor in (unscale, clip_coef):
            if factor is not None and factor != 1.0:
                out.mul_(factor)


class EventFence:
    """What the engine waits on before reusing a host buffer that a copy still reads."""

    def __init__(self, event):
        self.event = event

    def synchronize(self):
        self.event.synchronize()
