"""The host beside the GPU. What a rank holds in host memory beside the offload engine's buffers, for the
start-up guard (``mlp_offload.tiers.host.check_host_memory``, which adds up the node's ranks) and the planner.

Data workers are forked from the rank; the engine's buffers are left out of them (MADV_DONTFORK,
``mlp_offload.tiers.no_fork``), so a worker costs its own prefetched batches and the pages of the
rank it rewrites (Python's reference counts): counted at 32 MiB each, above what one measured on CPU with
mock data (tests/unit/test_planned_host_memory.py), for larger batches and datasets (docs/design.md, the
``runtime/host_memory.py`` row).

The GPU's host link, measured once at start-up where the params live in host memory: the update's copies of them
(``params_streaming.update_copies``) join the engine's predicted update at this rate.
"""

from __future__ import annotations

from typing import Dict, Optional

import torch

from megatron.training.errors import UserError
from mlp_offload import MiB, GiB, own_pss_bytes, unforked_zeros

DATA_WORKER_BYTES = 32 * MiB
# A rank process on a GPU node at its peak in the steps, beside the engine's buffers and the model's host memory
# (torch, the CUDA context's host side, NCCL buffers, the kernels' first use): the largest measured, with the
# node's own use (docs/benchmarks.md, section 28). The start-up guard counts the process as at least this.
PROCESS_BYTES_GPU = 9 * GiB
PROCESS_BYTES_CPU = GiB // 2  # a CPU rank after its imports, above what one measured (docs/design.md), model aside


def beside_engine(num_workers: int, process_bytes: int) -> Dict[str, int]:
    return {"process": int(process_bytes), "data workers": int(num_workers) * DATA_WORKER_BYTES}


def measured_beside_engine(num_workers: int, at_least: int = 0) -> Dict[str, int]:
    """This rank's figures now: its own proportional memory, and its workers to come. ``at_least``: what the
    process will hold in its steps where that is more (on a GPU: its peak beside what it holds of the model now;
    measured at start-up, before the first step, the process is smaller than it grows)."""
    return beside_engine(num_workers, max(own_pss_bytes(), at_least))


def host_zeros_to_pin(numel: int, dtype: torch.dtype) -> torch.Tensor:
    """``numel`` zeros of ``dtype`` in host memory that is committed only as it is written (the kernel's fresh
    anonymous pages), to be pinned in place once filled (``pin_in_place``): params copied in one by one, each old
    copy freed after it, never hold the node's memory twice, as a pinned allocation up front would."""
    itemsize = torch.empty(0, dtype=dtype).element_size()
    return unforked_zeros(numel * itemsize).view(dtype)


def pin_in_place(tensor: torch.Tensor, what: str) -> None:
    """Page-lock ``tensor``'s host memory where it lies (cudaHostRegister), for copies to and from the GPU that do
    not hold the host; a failure (the locked-memory limit, the node's memory) stops the run in one line."""
    nbytes = tensor.numel() * tensor.element_size()
    code = int(torch.cuda.cudart().cudaHostRegister(tensor.data_ptr(), nbytes, 0))
    if code != 0 or not tensor.is_pinned():
        raise UserError(f"{what}: pinning {nbytes / GiB:.2f} GiB of host memory failed (CUDA error {code}); raise "
                        f"the locked-memory limit (ulimit -l) or free host memory")


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
