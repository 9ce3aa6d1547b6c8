"""Which subgroups a step updates in which order, and which it keeps in host buffers afterwards."""

from __future__ import annotations

from dataclasses import dataclass
from typing import FrozenSet, List


@dataclass(frozen=True)
class StepSchedule:
    order: List[int]  # every subgroup, in update order
    streamed: List[int]  # the file-backed ones, in update order
    keep: FrozenSet[int]  # streamed subgroups left in host buffers (dirty) at the end of the step


def step_schedule(step_index: int, tier_of: List[str], cache_slots: int, alternate: bool) -> StepSchedule:
    """Ascending on even steps, descending on odd ones (when ``alternate``).

    The last ``cache_slots`` streamed subgroups stay in their buffers unwritten; the next step runs
    in reverse, so it starts with exactly those and skips both their write and their read.
    """
    n = len(tier_of)
    order = list(range(n)) if (step_index % 2 == 0 or not alternate) else list(range(n - 1, -1, -1))
    streamed = [i for i in order if tier_of[i] != "host"]
    keep = frozenset(streamed[len(streamed) - cache_slots:]) if (alternate and cache_slots) else frozenset()
    return StepSchedule(order, streamed, keep)
