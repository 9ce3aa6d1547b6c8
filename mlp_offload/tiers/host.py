"""Host memory for optimizer state: aligned (and, with CUDA, pinned) buffers under a byte budget."""

from __future__ import annotations

import logging
from typing import Dict, Optional, Tuple

import torch

from ..config.align import ALIGN
from .kinds import HOST_MEMORY
from .no_fork import unforked_zeros
from ..config.units import GiB

log = logging.getLogger("mlp_offload")


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
    name = HOST_MEMORY.name
    hands_out_zeros = True  # fresh anonymous pages: state starting at zero needs no pass of its own

    def __init__(self, budget_bytes: Optional[int], pin: Optional[bool] = None):
        self.budget_bytes = budget_bytes
        self.pin = pinning_available() if pin is None else pin
        if self.pin and not pinning_available():
            raise HostMemoryError("pinned host memory was requested (pin_memory=True) but CUDA is not available")
        self.used_bytes = 0
        self._registered = {}  # data_ptr -> tensor whose memory is registered with CUDA (pinned)
        self._counted = {}  # data_ptr of a handed-out buffer -> (its raw allocation, counted bytes)

    def allocate(self, nbytes: int, what: str, counted: bool = True) -> torch.Tensor:
        """An ALIGN-aligned, zero-filled uint8 buffer of ``nbytes``; ``counted`` ones count against the budget."""
        if counted and self.budget_bytes is not None and self.used_bytes + nbytes > self.budget_bytes:
            raise HostMemoryError(
                f"host budget exceeded allocating {what}: {nbytes / GiB:.3f} GiB needed, "
                f"{(self.budget_bytes - self.used_bytes) / GiB:.3f} GiB of "
                f"{self.budget_bytes / GiB:.3f} GiB left (raise host_budget_bytes)"
            )
        try:
            # Pinned by registering exactly-sized pageable memory: torch's pinned allocator rounds
            # each block up to a power of two, which nearly doubled a large budget's footprint.
            # Not inherited by the rank's children (data workers, checkpoint writers): each would
            # otherwise cost a copy of what the update rewrites, or of all of it once pinned.
            raw = unforked_zeros(nbytes + ALIGN, huge_pages=self.pin)
            if self.pin:
                # Faulted in by torch's threads first: cudaHostRegister faulting them itself was several
                # times slower, and huge pages on top are faster still (benchmarks/experiments/pinning.py).
                raw.zero_()
                self._register(raw)
        except (RuntimeError, OSError) as err:  # OSError: the mapping was refused
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
            # A relocation follows the step at once, and the step's end may have queued read-ahead
            # copies out of this very buffer: none may still read it once it is unpinned and freed.
            torch.cuda.synchronize()
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


def meminfo_bytes(field: str) -> Optional[int]:
    """A field of /proc/meminfo in bytes (as the host tier reads it), None where it is not there."""
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


# Some machines grow their memory on demand and report a fraction of it at start-up (docs/design.md, the
# ``tiers/host.py`` row): beyond this multiple of MemTotal a budget is a typo on any machine.
IMPLAUSIBLE_OVER_MEMTOTAL = 64


def check_budget_exists(budget_bytes: Optional[int], ranks: int) -> None:
    """A host budget the node cannot have is a typo, not a plan: refuse it before planning. The job's
    memory limit is exact; MemTotal can under-report, so beyond it is only a warning unless absurd."""
    if budget_bytes is None:
        return
    need = budget_bytes * ranks
    limit, total = _cgroup_limit_bytes(), meminfo_bytes("MemTotal")
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


def own_pss_bytes() -> int:
    """This process's proportional set size (shared pages split among their holders), else RSS."""
    for path, field, unit in (("/proc/self/smaps_rollup", "Pss:", 1024), ("/proc/self/status", "VmRSS:", 1024)):
        try:
            with open(path) as f:
                for line in f:
                    if line.startswith(field):
                        return int(line.split()[1]) * unit
        except OSError:
            continue
    return 0


def node_memory() -> Optional[Tuple[int, str]]:
    """(bytes, where from) that this node's ranks may hold in all: the job's memory limit (cgroup)
    where there is one (exact; on some multi-GPU nodes MemTotal grows as memory is used), else
    what the OS reports available plus what this rank holds already (each rank of the node about
    as much): both then count the ranks' whole memory, the process itself included."""
    limit = _cgroup_limit_bytes()
    if limit is not None:
        return limit, "this job's memory limit (cgroup)"
    available = meminfo_bytes("MemAvailable")
    if available is None:
        return None
    return available, "available memory (MemAvailable, plus what the ranks hold now)"


def check_host_memory(engine_bytes: Dict[str, int], ranks: int, beside_bytes: Dict[str, int],
                      budget_adjustable: bool, node: Optional[Tuple[int, str]] = None) -> None:
    """Before allocating: what each rank of the node will hold (the engine's buffers by name, and
    ``beside_bytes``: the process itself, its data workers...) times the ranks must fit ``node``
    (default ``node_memory()``), else an error naming the figures and the host_budget_bytes that
    would fit. ``budget_adjustable``: file tiers can take what a lower budget leaves out (the
    first entry of ``engine_bytes`` is what the budget bounds)."""
    if node is None:
        node = node_memory()
        if node is not None and node[1].startswith("available"):
            node = (node[0] + ranks * own_pss_bytes(), node[1])
    if node is None:
        return
    limit, source = node
    parts = {**engine_bytes, **beside_bytes}
    per_rank = sum(parts.values())
    if per_rank * ranks <= limit:
        return
    listed = ", ".join(f"{name} {nbytes / GiB:.2f}" for name, nbytes in parts.items())
    cache = next(iter(engine_bytes))
    room = limit / ranks - (per_rank - engine_bytes[cache])
    if budget_adjustable and room >= 0.1 * GiB:
        fix = f"host_budget_bytes={int(room / GiB * 10) / 10 * GiB:.0f} would fit"
    elif budget_adjustable:
        fix = "no host_budget_bytes fits: fewer ranks per node, or fewer data workers"
    else:
        fix = "lowering host_budget_bytes needs a file tier to take the rest (paths)"
    raise HostMemoryError(
        f"host memory: {ranks} rank(s) of this node x {per_rank / GiB:.2f} GiB ({listed} GiB) = "
        f"{per_rank * ranks / GiB:.2f} GiB, more than the {limit / GiB:.2f} GiB of {source}; {fix}")
