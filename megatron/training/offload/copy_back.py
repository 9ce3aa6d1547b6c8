"""The device-updated params' way back into host memory with --offload-params host: each piece the update hands
over is copied into one of two device staging buffers on the update's stream (the update reuses its own buffer
at once), then into the host buffer on a side stream, so the copy back across PCIe runs beside the next piece's
read and update instead of after them. On a CPU run (the twin) it is a plain copy."""

from __future__ import annotations

from typing import List, Optional, Sequence, Tuple

import torch


class CopyBack:
    """``put(source, targets)``: ``source[lo:hi]`` into each ``(host_view, lo, hi)``; ``wait()``: every copy put
    so far is in host memory (before anything on the host, or on another stream, reads it)."""

    def __init__(self, stream: Optional["torch.cuda.Stream"]):
        self.stream = stream
        self._staging: List[Optional[torch.Tensor]] = [None, None]
        self._done: List[Optional["torch.cuda.Event"]] = [None, None]
        self._turn = 0

    def put(self, source: torch.Tensor, targets: Sequence[Tuple[torch.Tensor, int, int]]) -> None:
        if self.stream is None or not source.is_cuda:
            for view, lo, hi in targets:
                view.copy_(source[lo:hi])
            return
        turn, self._turn = self._turn, 1 - self._turn
        compute = torch.cuda.current_stream(source.device)
        if self._done[turn] is not None:
            compute.wait_event(self._done[turn])  # this staging buffer's last copy out has read it
        staging = self._staging[turn]
        if staging is None or staging.numel() < source.numel() or staging.dtype != source.dtype:
            staging = self._staging[turn] = torch.empty(source.numel(), dtype=source.dtype, device=source.device)
        staged = staging[: source.numel()]
        staged.copy_(source)
        ready = torch.cuda.Event()
        ready.record(compute)
        self.stream.wait_event(ready)
        with torch.cuda.stream(self.stream):
            for view, lo, hi in targets:
                view.copy_(staged[lo:hi], non_blocking=True)
            done = torch.cuda.Event()
            done.record(self.stream)
        self._done[turn] = done

    def wait(self) -> None:
        if self.stream is not None:
            self.stream.synchronize()
