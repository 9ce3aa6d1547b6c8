"""Where the update's fp32 gradients come from: one interface, two sources.

``HostGradients`` (the CPU path, and the CPU twin of the GPU one): the caller copies low-precision
gradients into a host buffer; each subgroup's are converted to fp32 (unscaled, clipped) when the
update asks for them. On a GPU the Megatron adapter's source casts them on the device and copies
each subgroup over PCIe while the previous subgroup's Adam runs.
"""

from __future__ import annotations

from typing import Iterator, Optional, Protocol, Tuple

import torch

from .subgroups.partition import FP32_BYTES
from .kernels.update import convert_grads


class GradientSource(Protocol):
    """Delivers a subgroup's fp32 gradients, already unscaled and clipped, into ``out``."""

    def start(self, start: int, end: int, out: torch.Tensor, unscale: Optional[float],
              clip_coef: Optional[float]) -> None:
        """Begin filling ``out`` with the gradients of elements [start, end)."""

    def wait(self, start: int) -> None:
        """Return once the gradients started for ``start`` are in ``out``."""

    def to_device(self, start: int, end: int, out: torch.Tensor, unscale: Optional[float],
                  clip_coef: Optional[float]) -> None:
        """Fill ``out``, a tensor on the model's device, in the current stream's order (for the
        subgroups updated on the device: their grads never go to the host)."""

    # Optional (``ModelBuffers``): ``views(start, end)``, the grads of [start, end) where they are
    # kept, as (flat start, flat end, view) pieces in their training dtype; ``zero_after_read``.


class HostGradients:
    """``buffer``: the shard's gradients in their training dtype, filled by the caller; converted
    into ``out`` when waited for (so one fp32 scratch serves every subgroup)."""

    views_on_host = True  # (ModelBuffers: a device's kernel cannot read them in place)

    def __init__(self, buffer: torch.Tensor):
        self.buffer = buffer
        self._pending = {}

    def start(self, start: int, end: int, out: torch.Tensor, unscale: Optional[float],
              clip_coef: Optional[float]) -> None:
        self._pending[start] = (end, out, unscale, clip_coef)

    def wait(self, start: int) -> None:
        end, out, unscale, clip_coef = self._pending.pop(start)
        convert_grads(self.buffer[start:end], out, unscale, clip_coef)

    def to_device(self, start: int, end: int, out: torch.Tensor, unscale: Optional[float],
                  clip_coef: Optional[float]) -> None:
        convert_grads(self.buffer[start:end], out, unscale, clip_coef)  # the CPU twin: same arithmetic

    def views(self, start: int, end: int):
        yield start, end, self.buffer[start:end]


Piece = Tuple[int, int, torch.Tensor, torch.Tensor]


class ModelBuffers:
    """The model's own gradients and params on the update's device, by shard element range: where
    the device's one-pass kernel reads the grads (converting them itself) and writes the params in
    place, instead of an fp32 copy of the grads going in and the params being copied back out (about
    16 of the 36 bytes an element moved). From a gradient source and a param source that both
    give ``views``; None (``of``) where either does not."""

    def __init__(self, grads, params):
        self.grads, self.params = grads, params

    @staticmethod
    def available(grads, params, device: str) -> bool:
        """Whether both sources (instances, or a source's class) give ``views`` the update on
        ``device`` can read: a HostGradients' are host memory, which a CUDA kernel cannot."""
        if getattr(grads, "views_on_host", False) and torch.device(device).type != "cpu":
            return False
        return hasattr(grads, "views") and hasattr(params, "views")

    @classmethod
    def of(cls, grads, params, device: str) -> Optional["ModelBuffers"]:
        return cls(grads, params) if cls.available(grads, params, device) else None

    @property
    def zero_grads(self) -> bool:
        """Whether the update zeroes each grad it reads (the training loop then does not)."""
        return bool(getattr(self.grads, "zero_after_read", False))

    def pieces(self, start: int, end: int) -> Iterator[Piece]:
        """(flat start, flat end, grad view, param view) over [start, end), where both are contiguous."""
        params = list(self.params.views(start, end))
        for g_lo, g_hi, grad in self.grads.views(start, end):
            for p_lo, p_hi, param in params:
                lo, hi = max(g_lo, p_lo), min(g_hi, p_hi)
                if lo < hi:
                    yield lo, hi, grad[lo - g_lo: hi - g_lo], param[lo - p_lo: hi - p_lo]


def gradient_host_bytes(numel: int, largest: int, host_grad_itemsize: Optional[int]) -> int:
    """Host memory of the update's gradients: two fp32 scratch buffers of the largest subgroup when
    another source fills them (a GPU's), else (``HostGradients``, the CPU path) the shard's
    gradients in their training dtype (``host_grad_itemsize`` bytes each) and one fp32 scratch."""
    if host_grad_itemsize is None:
        return 2 * largest * FP32_BYTES
    return numel * host_grad_itemsize + largest * FP32_BYTES


def scratch_buffers(source_owned: bool, largest: int, allocate) -> Tuple[torch.Tensor, torch.Tensor]:
    """Two fp32 buffers the update alternates between: pinned and distinct when another source
    fills one while the update reads the other; one plain buffer twice for ``HostGradients``,
    which fills it only when waited for."""
    if source_owned:
        return tuple(allocate(largest * FP32_BYTES, "gradient scratch", counted=False).view(torch.float32)
                     for _ in range(2))
    one = torch.empty(largest, dtype=torch.float32)
    return one, one
