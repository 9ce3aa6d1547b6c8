"""The whole state, a subgroup at a time, for checkpoints and tests: streamed out of whatever tier
holds it, replaced, or edited in place, through one scratch buffer (nothing gathers the whole
state)."""

from __future__ import annotations

from typing import Callable, Dict, Iterator, List, Tuple

import torch

from .pipeline import SlotPipeline, StateViews
from .subgroups import Subgroup

StateFn = Callable[[Subgroup, torch.Tensor, torch.Tensor, torch.Tensor], None]


class StateAccess:
    def __init__(self, subgroups: List[Subgroup], resident: Dict[int, StateViews], pipeline: SlotPipeline,
                 scratch: Callable[[], StateViews]):
        self.subgroups = subgroups
        self.resident = resident
        self.pipeline = pipeline
        self._make_scratch = scratch  # allocated on first need, outside the host budget
        self._scratch = None

    def iter_state(self) -> Iterator[Tuple[Subgroup, torch.Tensor, torch.Tensor, torch.Tensor]]:
        """Each subgroup's (param, exp_avg, exp_avg_sq); valid until the next item is requested."""
        for i, sg, views in self._each(fill_missing=True):
            yield (sg, *views.narrow(sg.numel))

    def load_state(self, fill: StateFn) -> None:
        """Replace the whole state: ``fill`` writes each subgroup's three fp32 tensors in place."""
        self.pipeline.flush()
        self.pipeline.forget_buffers()  # the in-memory copies are about to be stale
        for i, sg, views in self._each(fill_missing=False):
            fill(sg, *views.narrow(sg.numel))
            if i not in self.resident:
                self.pipeline.write_now(i, views)
        self.pipeline.all_materialized()

    def modify_state(self, edit: StateFn) -> None:
        """Stream each subgroup's state through ``edit`` (in place); the result goes back where it lives."""
        for i, sg, views in self._each(fill_missing=True):
            edit(sg, *views.narrow(sg.numel))
            if views is self._scratch:  # host-resident or in a buffer: written later by the pipeline
                self.pipeline.write_now(i, views)

    def _each(self, fill_missing: bool) -> Iterator[Tuple[int, Subgroup, StateViews]]:
        """(index, subgroup, views): its resident or buffered copy, else the scratch buffer (filled
        from its tier when ``fill_missing``)."""
        self.pipeline.flush()
        for i, sg in enumerate(self.subgroups):
            views = self.resident.get(i)
            if views is None and fill_missing:
                views = self.pipeline.current_views(i)
            if views is None:
                views = self._scratch_views()
                if fill_missing:
                    self.pipeline.fill_from_tier(i, views)
            yield i, sg, views

    def _scratch_views(self) -> StateViews:
        if self._scratch is None:
            self._scratch = self._make_scratch()
        return self._scratch
