"""Device-to-host copies made by a background thread without holding back the training thread.

A copy from device memory into pageable host memory keeps the CUDA driver busy for its whole length, and
the kernel launches of every other thread of the process wait behind it: a checkpoint writer's copy aside
holds the training steps back for as long as it runs. ``copy_to_host`` moves such a copy
through two small pinned buffers instead: each piece's DMA only ever touches pinned memory, and the CPU
copies one piece into its destination while the next one moves.
"""

from __future__ import annotations

import threading
from contextlib import contextmanager
from typing import Callable, Iterator, List

import torch

PIECE = 32 * 2 ** 20  # bytes a piece: what the training thread may wait behind at most

# Every pinned pair made stays referenced here, never only from a thread: a forked child (torch_dist's
# writer) drops the other threads' state, and a pinned buffer or event freed there is a CUDA call in a
# child, which aborts it. Pairs are reused, so there are as many as threads ever copied at once.
_made: List["_Bounce"] = []
_free: List["_Bounce"] = []
_pairs = threading.Lock()


def copy_to_host(dst: torch.Tensor, src: torch.Tensor) -> None:
    """``dst.copy_(src)``; where ``src`` is on a GPU and ``dst`` in host memory, piece by piece
    through pinned memory on the current stream (returns once ``dst`` holds the bytes)."""
    # dst.is_pinned() is not asked: a range registered and freed unregistered still reads as pinned for a buffer
    # mapped there later, and a direct copy's DMA then goes to the old pages, never to dst
    bytewise = (src.is_cuda and not dst.is_cuda and src.dtype == dst.dtype
                and src.numel() == dst.numel() and src.is_contiguous() and dst.is_contiguous())
    if not bytewise or src.numel() == 0:
        dst.copy_(src)
        return
    with _bounce_for(src.device) as bounce:
        _copy_through(bounce, dst, src)


def _copy_through(bounce: "_Bounce", dst: torch.Tensor, src: torch.Tensor) -> None:
    stream = torch.cuda.current_stream(src.device)

    def move(k: int, piece: torch.Tensor) -> None:
        bounce.buffers[k][:piece.numel()].copy_(piece, non_blocking=True)
        bounce.events[k].record(stream)

    def land(k: int, target: torch.Tensor) -> None:
        bounce.events[k].synchronize()
        target.copy_(bounce.buffers[k][:target.numel()])

    copy_in_pieces(dst.reshape(-1).view(torch.uint8), src.reshape(-1).view(torch.uint8), PIECE, move, land)


def copy_in_pieces(dst: torch.Tensor, src: torch.Tensor, piece: int,
                   move: Callable[[int, torch.Tensor], None], land: Callable[[int, torch.Tensor], None]) -> None:
    """``src`` into ``dst`` (equal uint8 vectors) through two buffers, alternately: ``move(k, part)`` starts
    the part into buffer ``k``; ``land(k, target)`` waits for it and copies buffer ``k`` into ``target``.
    Each buffer is landed before it is moved into again, so one part lands while the next one moves."""
    moving = None  # (buffer, the part of dst its bytes go to)
    for n, start in enumerate(range(0, src.numel(), piece)):
        k = n % 2
        move(k, src[start:start + piece])
        if moving is not None:
            land(*moving)
        moving = (k, dst[start:start + piece])
    if moving is not None:
        land(*moving)


def reserve(device: torch.device) -> None:
    """Make one pair for ``device`` now, where none is free: a pinned allocation waits for the work queued on
    the device, so a writer's first copy must not be the one to make it (the caller is the training thread)."""
    with _bounce_for(device):
        pass


class _Bounce:
    def __init__(self, device: torch.device):
        self.buffers = [torch.empty(PIECE, dtype=torch.uint8, pin_memory=True) for _ in range(2)]
        self.events = [torch.cuda.Event() for _ in range(2)]
        self.device = device


@contextmanager
def _bounce_for(device: torch.device) -> Iterator[_Bounce]:
    with _pairs:
        bounce = next((b for b in _free if b.device == device), None)
        if bounce is not None:
            _free.remove(bounce)
    if bounce is None:
        with torch.cuda.device(device):
            bounce = _Bounce(device)
        with _pairs:
            _made.append(bounce)
    try:
        yield bounce
    finally:
        for event in bounce.events:  # a copy given up midway: no DMA may still land in a pair handed out again
            event.synchronize()
        with _pairs:
            _free.append(bounce)
