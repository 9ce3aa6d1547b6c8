"""Where the layer-major step (``layer_major``) keeps each layer's inputs between its forward and its recompute:
left where the forward made them, nowhere (a forward-only step), or in host memory fetched back a layer ahead."""

from __future__ import annotations

import contextlib
from typing import Dict, List, Optional

import torch


class KeptInputs:
    """Each layer's inputs for its recompute, left where the forward made them."""

    def __init__(self):
        self._kept: Dict[int, List[torch.Tensor]] = {}

    def put(self, layer: int, tensors: List[torch.Tensor]) -> None:
        self._kept[layer] = list(tensors)

    def take(self, layer: int) -> List[torch.Tensor]:
        return self._kept.pop(layer)


class NoKeptInputs(KeptInputs):
    """A forward-only step's: nothing is recomputed, so no layer's inputs are kept."""

    def put(self, layer: int, tensors: List[torch.Tensor]) -> None:
        pass


class HostKeptInputs(KeptInputs):
    """Each layer's inputs in host memory (pinned with CUDA): copied out on a side stream as the forward
    makes them, copied back for the layer's backward, the next layer's while this one computes; so the
    GPU holds at most two layers' inputs instead of every layer's. On a CPU run, copies all the same."""

    def __init__(self, device: torch.device, stream: Optional["torch.cuda.Stream"] = None):
        """``stream``: the side stream of the copies (one for a whole run's passes), else a new one."""
        super().__init__()
        self._device = device
        self._stream = stream if stream is not None else side_stream(device)
        self._coming: Dict[int, List[torch.Tensor]] = {}

    def put(self, layer: int, tensors: List[torch.Tensor]) -> None:
        with self._on_side_stream():
            host = [torch.empty(t.shape, dtype=t.dtype, pin_memory=self._stream is not None) for t in tensors]
            for h, t in zip(host, tensors):
                h.copy_(t, non_blocking=True)
                if self._stream is not None:
                    t.record_stream(self._stream)  # its memory is not reused before the copy has read it
        super().put(layer, host)

    def take(self, layer: int) -> List[torch.Tensor]:
        self._fetch(layer)
        tensors = self._coming.pop(layer)
        if self._stream is not None:
            current = torch.cuda.current_stream(self._device)
            current.wait_stream(self._stream)
            for t in tensors:
                t.record_stream(current)
        self._fetch(layer - 1)  # the next layer's, under this one's backward
        return tensors

    def _fetch(self, layer: int) -> None:
        if layer < 0 or layer in self._coming:
            return
        with self._on_side_stream():
            self._coming[layer] = [h.to(self._device, non_blocking=True) for h in super().take(layer)]

    def _on_side_stream(self):
        if self._stream is None:
            return contextlib.nullcontext()
        self._stream.wait_stream(torch.cuda.current_stream(self._device))  # what it copies is computed
        return torch.cuda.stream(self._stream)


def side_stream(device: torch.device) -> Optional["torch.cuda.Stream"]:
    """A stream for copies beside the compute on ``device``; None off a GPU."""
    return torch.cuda.Stream(device) if device.type == "cuda" else None
