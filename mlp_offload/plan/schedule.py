"""THE per-step traffic model: which subgroups a step updates in which order, which streamed ones it
finds still in host buffers (hits: no read), and which it leaves there unwritten (kept). The engine
executes it (``pipeline``) and the prediction prices it (``prediction.predict_update``), so the two
cannot drift apart."""

from __future__ import annotations

from dataclasses import dataclass
from typing import FrozenSet, List, Sequence

from ..config import RESIDENT_TIERS


@dataclass(frozen=True)
class StepSchedule:
    order: List[int]  # every subgroup, in update order
    streamed: List[int]  # the file-backed ones (not in a resident tier), in update order
    keep: FrozenSet[int]  # streamed subgroups left in host buffers (dirty) at the end of the step
    hits: FrozenSet[int]  # streamed subgroups still in host buffers when the step starts (steady state)

    def reads(self) -> List[int]:
        return [i for i in self.streamed if i not in self.hits]

    def writes(self) -> List[int]:
        return [i for i in self.streamed if i not in self.keep]


def step_schedule(step_index: int, tier_of: List[str], slots: int, cache_slots: int,
                  alternate: bool, resident: Sequence[str] = RESIDENT_TIERS) -> StepSchedule:
    """Ascending on even steps, descending on odd ones (when ``alternate``).

    The last ``cache_slots`` streamed subgroups of a step stay in their buffers unwritten; the next
    step runs in reverse, so it starts with them. Every one of the ``slots`` buffers still holds one
    of the previous step's last subgroups (kept, or written and not yet reused): those are the hits,
    read from memory instead of their tier. Without ``alternate`` (the cache off) nothing is kept or
    reused across steps.
    """
    n = len(tier_of)
    ascending = step_index % 2 == 0 or not alternate
    order = list(range(n)) if ascending else list(range(n - 1, -1, -1))
    streamed = [i for i in order if tier_of[i] not in resident]
    if not (alternate and cache_slots):
        return StepSchedule(order, streamed, frozenset(), frozenset())
    keep = frozenset(streamed[max(0, len(streamed) - cache_slots):])
    hits = frozenset(streamed[: min(slots, len(streamed))])  # the previous step's tail, reversed
    return StepSchedule(order, streamed, keep, hits)
