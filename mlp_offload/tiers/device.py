"""The model's device memory as the top resident tier (``kinds.DEVICE_MEMORY``): subgroups kept there
are updated in place and leave the device only for checkpoints. On a CPU run the device is the CPU,
and this is plain memory: the same code path, which the CPU tests exercise (the CPU twin)."""

from __future__ import annotations

from typing import Dict, Optional

import torch

from .kinds import DEVICE_MEMORY
from ..config.units import GiB


class DeviceMemoryError(RuntimeError):
    """Device memory could not be had: over the tier's budget, or the allocator refused."""


class DeviceMemory:
    kind = "resident"  # tiers.base.ResidentTier
    name = DEVICE_MEMORY.name

    def __init__(self, device: str, budget_bytes: Optional[int]):
        self.device = torch.device(device)
        self.budget_bytes = budget_bytes
        self.used_bytes = 0
        self._sizes: Dict[int, int] = {}  # data_ptr -> counted bytes, for release

    def allocate(self, nbytes: int, what: str, counted: bool = True) -> torch.Tensor:
        if counted and self.budget_bytes is not None and self.used_bytes + nbytes > self.budget_bytes:
            raise DeviceMemoryError(
                f"gpu budget exceeded allocating {what}: {nbytes / GiB:.3f} GiB needed, "
                f"{(self.budget_bytes - self.used_bytes) / GiB:.3f} GiB of {self.budget_bytes / GiB:.3f} GiB left "
                f"(raise gpu_budget_bytes)")
        try:
            buf = torch.empty(nbytes, dtype=torch.uint8, device=self.device)
        except RuntimeError as err:  # torch.OutOfMemoryError is one
            raise DeviceMemoryError(f"could not allocate {nbytes / GiB:.3f} GiB of {self.device} memory for "
                                    f"{what} ({self.used_bytes / GiB:.3f} GiB already held): {err}") from err
        if counted:
            self.used_bytes += nbytes
            self._sizes[buf.data_ptr()] = nbytes
        return buf

    def release(self, buf: torch.Tensor) -> None:
        """Give a counted buffer back (a subgroup handed to a lower tier); the caller drops it."""
        self.used_bytes -= self._sizes.pop(buf.data_ptr(), 0)

    def grow(self, budget_bytes: int) -> None:
        """The auto mode's learnt size."""
        self.budget_bytes = budget_bytes

    def close(self) -> None:
        self._sizes.clear()
