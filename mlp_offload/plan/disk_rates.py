"""The file tiers' rates as the steps show them, for the prediction printed beside each step.

Start-up probes each file tier once, with about a gigabyte, and a shared disk's speed drifts: the steps of
one run moved their bytes faster than its probe had measured, so the prediction of that disk-bound update
was over; another run's was under. Where a step's update was bound by file I/O in
the prediction, the step's own time says how fast the tiers went: the median over the last ``STEPS`` such
steps scales every file tier's probed rates, and later predictions are priced at those.

Only the prediction follows: where subgroups live and which side updates them stay as chosen. One scale
serves all file tiers (the step's time is the busiest device's); steps under the overlap
(``defer_device_wait``) are not read, as their measured time is only the share the step waited for.
"""

from __future__ import annotations

import dataclasses
import statistics
from collections import deque
from typing import Dict, Optional

from ..config import TierBandwidth

STEPS = 3  # steps whose median sets the scale: one odd step moves the prediction no further than its neighbours
IO_BOUND = 0.9  # a step is read where the prediction's file I/O is at least this share of its update
MOVE = 0.05  # the scale changes only where the steps' median differs from it by more than this
# Shorter steps are read as the step's fixed costs, not the disk's: a small run's short steps of a few megabytes
# would otherwise price its disk far below the probe's rate (docs/design.md, "Rates, tokens and the prediction").
MIN_STEP_S = 0.5


def scaled(rate: TierBandwidth, scale: float) -> TierBandwidth:
    """``rate`` with every bandwidth it gives multiplied by ``scale``."""
    return dataclasses.replace(
        rate, read_bps=rate.read_bps * scale, write_bps=rate.write_bps * scale,
        mixed_bps=None if rate.mixed_bps is None else rate.mixed_bps * scale,
        shared_mixed_bps=None if rate.shared_mixed_bps is None else rate.shared_mixed_bps * scale)


class DiskRates:
    """The probed rates of the file tiers (``probed``) and the scale the steps have shown on them."""

    def __init__(self, probed: Dict[str, TierBandwidth]):
        self.probed = dict(probed)
        self.scale = 1.0
        self._seen = deque(maxlen=STEPS)

    @property
    def learnt(self) -> bool:
        return self.scale != 1.0

    @property
    def rates(self) -> Dict[str, TierBandwidth]:
        return {name: scaled(rate, self.scale) for name, rate in self.probed.items()}

    def observe(self, prediction, rec) -> Optional[str]:
        """After a step (``rec``, a ``StepRecord``) priced by ``prediction`` (at the current scale): the line
        saying the new scale where it moved, else None."""
        planned = sum(prediction.read_bytes.values()) + sum(prediction.write_bytes.values())
        moved = sum(t.read_bytes + t.write_bytes for t in rec.tiers.values())
        reads = sum(t.read_bytes for t in rec.tiers.values())
        if (rec.skipped or not planned or not reads or rec.update_s < MIN_STEP_S
                or prediction.io_s < IO_BOUND * prediction.update_s):
            return None
        # The scale at which the modelled I/O of the bytes this step moved takes as long as the step took.
        self._seen.append(self.scale * prediction.io_s * (moved / planned) / rec.update_s)
        median = statistics.median(self._seen)
        if abs(median / self.scale - 1) <= MOVE:
            return None
        self.scale = median
        return (f"file tiers' rates now {median:.2f}x the start-up probe's, from the last {len(self._seen)} "
                f"I/O-bound step(s) (this one: {moved / 1e9:.2f} GB in {rec.update_s:.2f} s, predicted "
                f"{prediction.update_s:.2f} s)")
