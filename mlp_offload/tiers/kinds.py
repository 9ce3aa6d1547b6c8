"""Every tier kind the engine knows, asked by name: the memory kinds (each described beside its
class) and a file tier for any other name. The one list a new memory kind joins."""

from __future__ import annotations

from typing import Tuple

from .base import TierKind
from .device import DEVICE_MEMORY
from .host import HOST_MEMORY

MEMORY_KINDS: Tuple[TierKind, ...] = tuple(sorted((DEVICE_MEMORY, HOST_MEMORY), key=lambda k: k.order))
_MEMORY_BY_NAME = {k.name: k for k in MEMORY_KINDS}


def kind_of(name: str) -> TierKind:
    """The kind of the tier the config names ``name``: a memory kind, else a file tier (streamed)."""
    return _MEMORY_BY_NAME.get(name) or TierKind(name, resident=False, order=len(MEMORY_KINDS))


def memory_kind_names() -> Tuple[str, ...]:
    """The memory kinds' names, fastest first."""
    return tuple(k.name for k in MEMORY_KINDS)
