"""The two kinds of tier. A new kind of memory is one class of either kind plus its ``TierKind`` in
``tiers.kinds`` (resident kinds); a streamed tier is any other name with a path in ``OffloadConfig.paths``.

- resident: a subgroup's state lives in the tier's memory between steps and is updated there
  (``tiers.device.DeviceMemory``: the model's device memory; ``tiers.host.HostMemory``: pinned
  host memory). ``tiers.factory`` builds them from the config.
- streamed: a subgroup's state lives in a file and passes through a host buffer for each update
  (``tiers.files.FileTier``: node-local NVMe, a parallel file system, any directory).
"""

from __future__ import annotations

from concurrent.futures import Future
from typing import Callable, ClassVar, ContextManager, Optional, Protocol, Sequence, Tuple

import torch

Extent = Tuple[int, torch.Tensor]  # (offset in the file, aligned uint8 host tensor)


class ResidentTier(Protocol):
    kind: ClassVar[str]  # "resident"
    name: str

    def allocate(self, nbytes: int, what: str, counted: bool = True) -> torch.Tensor:
        """An aligned buffer of ``nbytes``; ``counted`` ones count against the tier's budget."""

    def release(self, buf: torch.Tensor) -> None:
        """Give back a buffer ``allocate`` handed out (its subgroup moved to another tier)."""

    def close(self) -> None:
        """Release what the tier holds; no copy may still use its buffers."""


class StreamedTier(Protocol):
    kind: ClassVar[str]  # "streamed"
    name: str
    device: object  # tiers on one storage device share its bandwidth and free space

    block_bytes: int  # a file's CRCs are per block of this many bytes of each extent written

    def submit_read(self, key: str, extents: Sequence[Extent], before: Optional[Callable] = None,
                    after: Optional[Callable] = None, background: bool = False, first_block: int = 0) -> Future:
        """``background``: a checkpoint writer's read, which its ``activity`` does not count. ``first_block``:
        the extents are part of the file's, from its block of that number (their CRCs checked against those)."""

    activity: object  # tiers.activity.TierActivity: whether its own I/O is moving data now

    def step_window(self) -> ContextManager:
        """Around an update: busy to a paced background writer for its whole span (``TierActivity.window``)."""

    def submit_write(self, key: str, extents: Sequence[Extent], before: Optional[Callable] = None,
                     after: Optional[Callable] = None) -> Future: ...

    def submit(self, fn: Callable, *args) -> Future:
        """Run ``fn`` in the tier's operation order (e.g. materialising a subgroup's first state)."""

    def free_bytes(self) -> int: ...

    def link(self, key: str, alias: str) -> None:
        """A second name for ``key``'s current file (snapshots); its next write goes to a new file."""

    def forget(self, key: str) -> None:
        """Remove ``key``'s file."""

    def close(self, remove_files: bool = True) -> None:
        """Finish its I/O, release its tokens, remove its files unless told not to."""
