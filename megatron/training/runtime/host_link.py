"""The GPU's host link, measured once at start-up where the params live in host memory: the update's copies of them
(``params_streaming.update_copies``) join the engine's predicted update at this rate."""

from __future__ import annotations

from typing import Optional

import torch

from mlp_offload import MiB

PROBE_BYTES = 256 * MiB


def measured_link_bytes_per_s(device: torch.device, nbytes: int = PROBE_BYTES) -> Optional[float]:
    """One direction of ``device``'s host link (the slower of a pinned buffer's copy in and out), None off a GPU."""
    if device.type != "cuda":
        return None
    host = torch.empty(nbytes, dtype=torch.uint8).pin_memory()
    on_device = torch.empty(nbytes, dtype=torch.uint8, device=device)
    on_device.copy_(host)  # the first copies set up what later ones reuse: not timed
    host.copy_(on_device)
    rates = []
    for source, target in ((host, on_device), (on_device, host)):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        target.copy_(source, non_blocking=True)
        end.record()
        end.synchronize()
        rates.append(nbytes / (start.elapsed_time(end) / 1000.0))
    return min(rates)
