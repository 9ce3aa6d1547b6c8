"""Partition of one rank's flat fp32 shard into subgroups, and the byte layout of their state.

A subgroup's state is three fp32 tensors (master params, exp_avg, exp_avg_sq). In host buffers and
in files they sit in three regions, each padded to ALIGN bytes so O_DIRECT I/O can use them as-is.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import List

from .tiers.align import align_up

STATE_TENSORS = ("param", "exp_avg", "exp_avg_sq")
FP32_BYTES = 4


@dataclass(frozen=True)
class Subgroup:
    index: int
    start: int  # element offset in the rank's flat shard
    end: int

    @property
    def numel(self) -> int:
        return self.end - self.start

    @property
    def region_bytes(self) -> int:
        """Bytes of one of its three state regions, padded for O_DIRECT."""
        return align_up(self.numel * FP32_BYTES)

    @property
    def state_bytes(self) -> int:
        """Bytes its whole state occupies in a file or a host buffer (three padded regions)."""
        return len(STATE_TENSORS) * self.region_bytes


def partition(numel: int, subgroup_size: int) -> List[Subgroup]:
    """Split ``numel`` elements into subgroups of ``subgroup_size`` (the last one shorter)."""
    if numel <= 0:
        raise ValueError(f"cannot partition an empty shard (numel={numel})")
    if subgroup_size <= 0:
        raise ValueError(f"subgroup size must be positive, got {subgroup_size}")
    return [
        Subgroup(i, start, min(start + subgroup_size, numel))
        for i, start in enumerate(range(0, numel, subgroup_size))
    ]
