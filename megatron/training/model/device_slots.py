"""Device memory that groups of tensors living in host memory take turns in (``host_params``' layer slots for
params, ``host_grads``' for their grads): a flat tensor per dtype, each group's tensors laid out in it in order,
and the CUDA events that order its copies against the compute that uses it (None on a CPU run, where a copy is
done when it returns)."""

from __future__ import annotations

from typing import Dict, Iterable, List, Optional, Tuple

import torch


def dtype_sizes(tensors: Iterable[torch.Tensor]) -> Dict[torch.dtype, int]:
    """Elements per dtype of ``tensors``."""
    sizes: Dict[torch.dtype, int] = {}
    for t in tensors:
        sizes[t.dtype] = sizes.get(t.dtype, 0) + t.numel()
    return sizes


def largest_sizes(groups: Iterable[List[torch.Tensor]]) -> Dict[torch.dtype, int]:
    """Elements per dtype a slot needs to hold any one of ``groups``."""
    largest: Dict[torch.dtype, int] = {}
    for group in groups:
        for dtype, numel in dtype_sizes(group).items():
            largest[dtype] = max(largest.get(dtype, 0), numel)
    return largest


class DeviceSlot:
    def __init__(self, sizes: Dict[torch.dtype, int], device: torch.device):
        self.flat = {dtype: torch.empty(numel, dtype=dtype, device=device) for dtype, numel in sizes.items()}
        self.holds: Optional[int] = None  # the group whose tensors it holds now (params: this step)
        self.copied_in = None  # the copy into it of what it holds
        self.used = None  # the compute that used it last
        self.copied_out = None  # the copy of what it held back into host memory

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.flat.values())

    def runs(self, like: List[torch.Tensor], keys: List[object]) -> List[Tuple[object, torch.Tensor]]:
        """The part of the slot ``views(like)`` covers, as flat pieces: one per run of consecutive tensors of a
        dtype with the same key (``keys[i]`` is ``like[i]``'s), each with its key, in the order the runs start."""
        ends: Dict[torch.dtype, int] = {}
        last: Dict[torch.dtype, int] = {}  # each dtype's run still growing (its index in ``spans``)
        spans: List[list] = []  # [key, dtype, start, end]
        for t, key in zip(like, keys):
            at = ends.get(t.dtype, 0)
            ends[t.dtype] = at + t.numel()
            open_run = last.get(t.dtype)
            if open_run is not None and spans[open_run][0] is key:
                spans[open_run][3] = ends[t.dtype]
            else:
                last[t.dtype] = len(spans)
                spans.append([key, t.dtype, at, ends[t.dtype]])
        return [(key, self.flat[dtype][start:end]) for key, dtype, start, end in spans]

    def views(self, like: List[torch.Tensor]) -> List[torch.Tensor]:
        """A view of the slot for each tensor of ``like`` (its shape and dtype), in order."""
        offsets: Dict[torch.dtype, int] = {}
        views = []
        for t in like:
            at = offsets.get(t.dtype, 0)
            views.append(self.flat[t.dtype][at: at + t.numel()].view(t.shape))
            offsets[t.dtype] = at + t.numel()
        return views
