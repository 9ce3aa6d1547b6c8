"""Host memory for optimizer state: aligned (and, with CUDA, pinned) buffers under a byte budget."""

from __future__ import annotations

import logging
from typing import Optional

import torch

from .align import ALIGN

log = logging.getLogger("mlp_offload")
GiB = 1024**3


class HostMemoryError(RuntimeError):
    """Host memory could not be had: over the budget, or the OS refused to pin it."""


def pinning_available() -> bool:
    return torch.cuda.is_available()


class HostMemory:
    """Hands out aligned uint8 buffers and counts them against a budget.

    Pinned buffers let the GPU copy to and from them asynchronously; without CUDA they are plain
    memory. Alignment to ALIGN lets file tiers do O_DIRECT I/O straight from these buffers.
    """

    kind = "resident"  # tiers.base.ResidentTier
    name = "host"

    def __init__(self, budget_bytes: Optional[int], pin: Optional[bool] = None):
        self.budget_bytes = budget_bytes
        self.pin = pinning_available() if pin is None else pin
        if self.pin and not pinning_available():
            raise HostMemoryError("pinned host memory was requested (pin_memory=True) but CUDA is not available")
        self.used_bytes = 0
        self._registered = {}  # data_ptr -> tensor whose memory is registered with CUDA (pinned)
        self._counted = {}  # data_ptr of a handed-out buffer -> (its raw allocation, counted bytes)

    def allocate(self, nbytes: int, what: str, counted: bool = True) -> torch.Tensor:
        """An ALIGN-aligned uint8 buffer of ``nbytes``; ``counted`` ones count against the budget."""
        if counted and self.budget_bytes is not None and self.used_bytes + nbytes > self.budget_bytes:
            raise HostMemoryError(
                f"host budget exceeded allocating {what}: {nbytes / GiB:.3f} GiB needed, "
                f"{(self.budget_bytes - self.used_bytes) / GiB:.3f} GiB of "
                f"{self.budget_bytes / GiB:.3f} GiB left (raise host_budget_bytes)"
            )
        try:
            # Pinned by registering exactly-sized pageable memory: torch's pinned allocator rounds
            # each block up to a power of two, which nearly doubled a large budget's footprint.
            raw = torch.empty(nbytes + ALIGN, dtype=torch.uint8)
            if self.pin:
                self._register(raw)
        except RuntimeError as err:
            kind = "pinned " if self.pin else ""
            raise HostMemoryError(
                f"could not allocate {nbytes / GiB:.3f} GiB of {kind}host memory for {what} "
                f"({self.used_bytes / GiB:.3f} GiB already held): {err}. Lower "
                f"host_budget_bytes, or raise the locked-memory limit (ulimit -l)"
            ) from err
        shift = (-raw.data_ptr()) % ALIGN
        buf = raw[shift : shift + nbytes]
        if counted:
            self.used_bytes += nbytes
        self._counted[buf.data_ptr()] = (raw, nbytes if counted else 0)
        return buf

    def release(self, buf: torch.Tensor) -> None:
        """Give a buffer back (its subgroup moved to another tier); no copy may still use it."""
        raw, nbytes = self._counted.pop(buf.data_ptr(), (None, 0))
        self.used_bytes -= nbytes
        if raw is not None and self._registered.pop(raw.data_ptr(), None) is not None:
            torch.cuda.cudart().cudaHostUnregister(raw.data_ptr())

    def _register(self, raw: torch.Tensor) -> None:
        code = int(torch.cuda.cudart().cudaHostRegister(raw.data_ptr(), raw.numel(), 0))
        if code != 0:
            raise RuntimeError(f"cudaHostRegister failed with CUDA error {code}")
        self._registered[raw.data_ptr()] = raw

    def close(self) -> None:
        """Unpin what was pinned; the buffers must no longer be in use by copies."""
        while self._registered:
            torch.cuda.cudart().cudaHostUnregister(self._registered.popitem()[0])
        self._counted.clear()


def _meminfo_bytes(field: str) -> Optional[int]:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def _cgroup_limit_bytes() -> Optional[int]:
    for path in ("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory/memory.limit_in_bytes"):
        try:
            with open(path) as f:
                text = f.read().strip()
        except OSError:
            continue
        if text.isdigit() and int(text) < (1 << 60):
            return int(text)
    return None


# Some machines grow their memory on demand and report a fraction of it at start-up (8x seen):
# beyond this multiple of MemTotal a budget is a typo on any machine.
IMPLAUSIBLE_OVER_MEMTOTAL = 64


def check_budget_exists(budget_bytes: Optional[int], ranks: int) -> None:
    """A host budget the node cannot have is a typo, not a plan: refuse it before planning. The job's
    memory limit is exact; MemTotal can under-report, so beyond it is only a warning unless absurd."""
    if budget_bytes is None:
        return
    need = budget_bytes * ranks
    limit, total = _cgroup_limit_bytes(), _meminfo_bytes("MemTotal")
    what = (f"host_budget_bytes ({budget_bytes / GiB:g} GiB per rank): {ranks} rank(s) of this node x "
            f"{budget_bytes / GiB:g} GiB = {need / GiB:.1f} GiB")
    if limit is not None and need > limit:
        raise HostMemoryError(f"{what}, more than this job's memory limit of {limit / GiB:.1f} GiB; give at most "
                              f"{limit / ranks / GiB:.1f} per rank")
    if total is not None and need > IMPLAUSIBLE_OVER_MEMTOTAL * total:
        raise HostMemoryError(f"{what}, more than {IMPLAUSIBLE_OVER_MEMTOTAL}x this node's {total / GiB:.1f} GiB of "
                              f"memory; give at most {total / ranks / GiB:.1f} per rank")
    if total is not None and need > total:
        log.warning("%s exceeds the %.1f GiB of memory this node reports now; fine only where memory grows on "
                    "demand", what, total / GiB)


def check_host_memory(per_rank_bytes: int, ranks: int) -> None:
    """Before allocating: the node's ranks together must fit a hard memory limit (an error, naming
    the numbers); beyond what the OS reports available is only a warning, because some machines
    grow their memory on demand and report too little at start-up."""
    need = per_rank_bytes * ranks
    limit = _cgroup_limit_bytes()
    if limit is not None and need > limit:
        raise HostMemoryError(
            f"host memory: {ranks} rank(s) x {per_rank_bytes / GiB:.2f} GiB = {need / GiB:.2f} GiB of "
            f"optimizer buffers exceed this job's memory limit of {limit / GiB:.2f} GiB; lower "
            f"host_budget_bytes (or subgroup_size) or add file tiers")
    available = _meminfo_bytes("MemAvailable")
    if available is not None and need > available:
        log.warning("host memory: %d rank(s) x %.2f GiB = %.2f GiB of optimizer buffers, but the OS reports "
                    "only %.2f GiB available; lower host_budget_bytes if the job gets OOM-killed",
                    ranks, per_rank_bytes / GiB, need / GiB, available / GiB)
