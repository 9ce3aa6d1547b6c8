"""Every tier kind the engine knows, and the one place their names are spelled: the memory kinds
(each class takes its name from its kind here) and a file tier for any other name. Config checks,
placement, prediction, relocation and the adapter ask a tier's kind (``kind_of``) instead of
comparing its name. A new memory kind is its class plus one ``TierKind`` in ``MEMORY_KINDS``.

Imports nothing of the engine: ``config`` asks it too."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Tuple


@dataclass(frozen=True)
class TierKind:
    """What every layer asks of a tier instead of its name."""
    name: str  # as the config's ``tiers`` lists it
    resident: bool  # memory, where subgroups are updated in place; else a file path, streamed
    in_device_memory: bool = False  # the model's device memory (its subgroups update on the device)
    budget_field: Optional[str] = None  # the OffloadConfig field sizing a memory tier (None: a file tier)
    order: int = 0  # place among the memory tiers, fastest first (placement fills them so)

    @property
    def needs_path(self) -> bool:
        """A file tier: its directory is ``OffloadConfig.paths[name]``."""
        return not self.resident


# tiers.device.DeviceMemory; its budget is None with gpu_budget_auto (learnt from the steps).
DEVICE_MEMORY = TierKind("gpu", resident=True, in_device_memory=True, budget_field="gpu_budget_bytes", order=0)
# tiers.host.HostMemory: always built (it holds the pipeline's buffers); listed, it keeps subgroups too.
HOST_MEMORY = TierKind("host", resident=True, budget_field="host_budget_bytes", order=1)

MEMORY_KINDS: Tuple[TierKind, ...] = tuple(sorted((DEVICE_MEMORY, HOST_MEMORY), key=lambda k: k.order))
_MEMORY_BY_NAME = {k.name: k for k in MEMORY_KINDS}


def kind_of(name: str) -> TierKind:
    """The kind of the tier the config names ``name``: a memory kind, else a file tier (streamed)."""
    return _MEMORY_BY_NAME.get(name) or TierKind(name, resident=False, order=len(MEMORY_KINDS))


def memory_kind_names() -> Tuple[str, ...]:
    """The memory kinds' names, fastest first."""
    return tuple(k.name for k in MEMORY_KINDS)
