"""The params in host memory while megatron-core's DDP builds its param and grad buffers, where those
would not fit beside them on the device."""

from __future__ import annotations

import os
from typing import Optional

import torch

from mlp_offload import GiB


def stage_params_on_host(chunks, ddp_config) -> Optional[str]:
    """DDP copies the params into a device buffer of its own and allocates the grad buffer beside it before
    the params' own memory goes: the device holds the params about three times over, which ran a large
    model out of memory. Where that would not fit, the params wait in
    host memory meanwhile (a copy each way, seconds); the values are the same bits. Returns the line that
    says so where it staged them, else None."""
    params = [p for chunk in chunks for p in chunk.parameters()]
    forced = os.environ.get("MLP_OFFLOAD_STAGE_PARAMS") == "1"  # the path run where it is not needed (its tests)
    on_cuda = bool(params) and params[0].is_cuda
    if not params or not (on_cuda or forced):
        return None
    param_bytes = sum(p.numel() * p.element_size() for p in params)
    grad_bytes = sum(p.numel() for p in params) * (4 if ddp_config.grad_reduce_in_fp32 else params[0].element_size())
    free = torch.cuda.mem_get_info()[0] if on_cuda else 0
    if ddp_buffers_fit(param_bytes, grad_bytes, free) and not forced:
        return None
    line = (f"> model: {param_bytes / GiB:.1f} GiB of params per rank staged in host memory while DDP builds "
            f"its param and grad buffers ({(param_bytes + grad_bytes) / GiB:.1f} GiB beside "
            f"{free / GiB:.1f} GiB free)")
    for chunk in chunks:
        chunk.cpu()
    if on_cuda:
        torch.cuda.empty_cache()
    return line


# Left free beside DDP's buffers while they are built (allocator rounding, CUDA's own use).
STAGING_MARGIN_BYTES = 2 * GiB


def ddp_buffers_fit(param_bytes: int, grad_bytes: int, free_bytes: int) -> bool:
    """Whether DDP's param and grad buffers fit beside the params already on the device."""
    return param_bytes + grad_bytes + STAGING_MARGIN_BYTES <= free_bytes
