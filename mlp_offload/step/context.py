"""What both update sides share: one step's context, and the interface each side offers the engine's
step loop (``cpu_side.CpuUpdate``, ``device_side.DeviceSide``).

A side is built once with what it needs for every step (subgroups, their param-group pieces, the
gradient source, the params' way back); each step it is given the ``StepContext`` and then one
subgroup at a time with that subgroup's state, and answers with a fence: the point after which the
host may touch that state again.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Protocol, Sequence

from ..telemetry import StepRecord


@dataclass(frozen=True)
class StepContext:
    step: int  # AdamW's step count for this update
    unscale: Optional[float]  # 1/loss-scale, applied to the gradients first
    clip_coef: Optional[float]  # then the clip coefficient
    # The param groups' hyperparameters as the step began: a deferred device update may run after the
    # caller's scheduler changed them.
    groups: Sequence[dict]
    record: StepRecord  # the step's times and counts go here


class Fence(Protocol):
    def synchronize(self) -> None: ...

    def query(self) -> bool: ...


class UpdateSide(Protocol):
    def begin(self, ctx: StepContext, order: Sequence[int]) -> None:
        """A step starts; ``order``: the subgroups this side will be given, in that order."""

    def update(self, i: int, views) -> Fence:
        """Subgroup ``i``'s update on its state ``views`` (``pipeline.StateViews``)."""
