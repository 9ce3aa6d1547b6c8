"""The optimizer state where the placement puts it in memory, at its start values, and the pipeline's
host buffers for the subgroups streamed from file tiers (their start values are written on first read)."""

from __future__ import annotations

import logging
import time
from typing import Dict, List, Mapping, Sequence, Tuple

from ..pipeline import StateViews, fill_params, starts_at_zero
from ..plan.placement import Placement
from ..subgroups.partition import Subgroup, slot_subgroup
from ..config.units import GB

log = logging.getLogger("mlp_offload")


def allocate_initial_state(subgroups: Sequence[Subgroup], placement: Placement, memory: Mapping[str, object],
                           host, params) -> Tuple[Dict[int, StateViews], List[StateViews]]:
    """(the views of each subgroup ``placement`` holds in a memory tier, its pipeline buffers). Pinning
    tens of GB takes a while: a line before and after, with size and rate."""
    kind = "pinned " if host.pin else ""
    tier_of, slots = placement.tier_of, placement.slots
    state_gb = placement.host_state_bytes / GB
    log.info("allocating %.3f GB of %shost memory for optimizer state ...", state_gb, kind)
    started = time.perf_counter()
    resident: Dict[int, StateViews] = {}
    for i, tier in enumerate(tier_of):
        if tier not in memory:
            continue
        sg = subgroups[i]
        # Fresh host memory is zeros already: moments (and remainders of masters that start as the
        # model's params) need no second pass over tens of GB.
        zeroed = getattr(memory[tier], "hands_out_zeros", False)
        views = StateViews.over(memory[tier].allocate(sg.state_bytes, f"subgroup {i}"), sg)
        if not (zeroed and starts_at_zero(params, sg)):
            fill_params(params, sg, views.param[: sg.numel])
        if not zeroed:
            views.exp_avg.zero_()
            views.exp_avg_sq.zero_()
        resident[i] = views
    slot_sg = slot_subgroup(subgroups)
    buffers = [StateViews.over(host.allocate(slot_sg.state_bytes, f"pipeline buffer {k}"), slot_sg)
               for k in range(slots)]
    seconds = time.perf_counter() - started
    log.info("allocated %.3f GB of %shost memory for optimizer state in %.1f s (%.2f GB/s)", state_gb, kind,
             seconds, state_gb / max(seconds, 1e-9))
    return resident, buffers
