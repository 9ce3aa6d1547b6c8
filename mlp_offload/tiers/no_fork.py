"""Host buffers that child processes do not inherit (``MADV_DONTFORK``).

A rank forks children while it trains: DataLoader workers (``--num-workers``, for the whole run),
checkpoint writers. A forked child shares the rank's memory copy-on-write, so every page of the
optimizer's host cache that the update rewrites while a child lives is copied once more; and pages
pinned for DMA (cudaHostRegister) are copied into the child eagerly, at the fork. Either way each
child cost a copy of the cache. No child reads these buffers (the offloaded state is saved by a
thread of the rank), so they are mapped on their own and the kernel is told to leave them out of
children. Their own mapping, not the allocator's memory: marking part of the heap would outlive
the buffer and hide from children whatever the allocator puts there next.
"""

from __future__ import annotations

import mmap
import sys

import torch

from ..config.align import ALIGN


def unforked_zeros(nbytes: int, huge_pages: bool = False) -> torch.Tensor:
    """A zero-filled (the kernel's fresh anonymous pages), page-aligned uint8 buffer of ``nbytes`` that
    forked children do not get (they must never touch it). Freed when the last tensor viewing it is.
    Linux only; elsewhere ordinary memory. ``huge_pages``: ask the kernel for transparent huge pages
    (where it grants them on request: fewer pages to fault in and to pin)."""
    if not sys.platform.startswith("linux") or nbytes == 0:
        return torch.zeros(nbytes, dtype=torch.uint8)
    region = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    region.madvise(mmap.MADV_DONTFORK)
    if huge_pages and hasattr(mmap, "MADV_HUGEPAGE"):
        region.madvise(mmap.MADV_HUGEPAGE)
    return torch.frombuffer(region, dtype=torch.uint8)  # holds a reference to the mapping


def aligned_empty(nbytes: int) -> torch.Tensor:
    """An uninitialised uint8 buffer of ``nbytes`` starting on an ALIGN boundary, in transparent huge pages
    where the kernel grants them: a checkpoint's staging and I/O buffers, filled beside training, fault in a
    page per 2 MiB rather than per 4 KiB."""
    raw = unforked_zeros(nbytes + ALIGN, huge_pages=True)  # state snapshots: no child of the rank reads them
    shift = (-raw.data_ptr()) % ALIGN
    return raw[shift: shift + nbytes]
