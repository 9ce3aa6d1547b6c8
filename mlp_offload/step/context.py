"""What both update sides share: one step's context, what each side is built with, and the
interface each side offers the engine's step loop (``cpu_side.CpuUpdate``, ``device_side.DeviceSide``).

A side is built once, complete, with what it needs for every step (subgroups, their param-group
pieces, the gradient source, the params' way back, the kernel ``update_paths`` chose); each step it is
given the ``StepContext`` and then one subgroup at a time with that subgroup's state, and answers
with a fence: the point after which the host may touch that state again. ``end`` closes the step.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Callable, Mapping, Optional, Protocol, Sequence

from ..telemetry.traffic import StepRecord


class Fence(Protocol):
    def synchronize(self) -> None: ...

    def query(self) -> bool: ...


@dataclass(frozen=True)
class StepContext:
    step: int  # AdamW's step count for this update
    unscale: Optional[float]  # 1/loss-scale, applied to the gradients first
    clip_coef: Optional[float]  # then the clip coefficient
    # The param groups' hyperparameters as the step began: a deferred device update may run after the
    # caller's scheduler changed them.
    groups: Sequence[dict]
    record: StepRecord  # the step's times and counts go here
    # Per subgroup: the fence of the last deferred step's copy out of its state, which may still run
    # (``DeferredWork.release``): a device update's copy in follows it, the CPU waits for it first.
    written: Mapping[int, Fence] = field(default_factory=lambda: MappingProxyType({}))
    # A deferred step the caller waits for before the next forward (the overlap's settled steps, or the
    # overlap turned off): queued in a step in series' order, not the next forward's (``loop.held_first_order``)
    in_series: bool = False


@dataclass(frozen=True)
class SideInputs:
    """What both sides are built with: the subgroups, each one's param-group pieces, where gradients
    come from and where updated params go."""
    subgroups: Sequence  # subgroups.Subgroup
    segments: Sequence[Sequence]  # per subgroup: its param_groups.Segment pieces
    grad_source: object  # gradients.GradientSource
    on_params: Optional[Callable]  # (start, end, params) -> fence or None; None: nobody wants them
    param_high: object = None  # kernels.remainders.ParamHighSource of a master stored as remainders, else None
    trace: object = None  # trace.Trace, or None
    blocks: object = None  # 8-bit moments: subgroups.blocks.SubgroupBlocks (each subgroup's pieces), else None


class UpdateSide(Protocol):
    """One way of updating subgroups (the CPU's, the device's). ``asynchronous``: ``update`` may return
    before the work is done (queued on a device); the loop then hands it the subgroups held in memory
    first, all of them, so that it works through them while the host runs the rest, and keeps a
    streamed subgroup's buffer until its fence."""

    asynchronous: bool

    def begin(self, ctx: StepContext, order: Sequence[int]) -> None:
        """A step starts; ``order``: the subgroups this side will be given, in that order."""

    def update(self, i: int, views) -> Fence:
        """Subgroup ``i``'s update on its state ``views`` (``pipeline.StateViews``)."""

    def end(self) -> None:
        """The step's last subgroup was given (a deferred device step: the next step's start)."""
