"""The CPU's share under ``defer_device_wait`` re-chosen from the steps themselves (``overlap_split``
prices it): the CPU's rate beside the streaming device as the steps show it, and the forward's length.

The start-up's rate of the CPU beside the device comes from a probe that updates 2 M elements at a time,
each piece's gradient and param copies queued behind the device's streamed copies: it reads far below
the CPU's one pass alone, and priced that way the CPU gets nothing (docs/design.md, "Placement"). A
deferred step's CPU share shows its own rate: its Adam, gradient and params time over its elements,
while the device streams its share beside it. So where nothing has measured it yet and the start-up's
rates give the CPU no share, one step runs with a small one (``PROBE_SUBGROUPS``; at the probe's rate
about a second more for that step); from then on each step with a share measures it again, and the rate
is the median of the last ``SAMPLES`` steps'. A move needs a predicted gain over ``GAIN`` and over
``NOISE_Z`` of the measured rates' relative spread (split.py's settling), except the first after that
probe. On the CPU twin nothing runs beside anything: nothing is learnt here; nor where ``frozen``
(deterministic runs): the sides stay as start-up chose them."""

from __future__ import annotations

import dataclasses
import statistics
from typing import List, Optional, Sequence, Tuple

from ..subgroups.partition import Subgroup
from ..tiers.kinds import kind_of
from .overlap_split import OverlapChoice, deferred_split
from .placement import CPU, DEVICE, UpdateRates, spread
from .split import GAIN, NOISE_Z, SAMPLES, relative_noise

PROBE_SUBGROUPS = 2  # host-held subgroups the CPU updates in the step that times it


def host_resident(tier_of: Sequence[str]) -> List[int]:
    """The subgroups held in host memory (the ones the CPU's share is taken from)."""
    return [i for i, t in enumerate(tier_of) if kind_of(t).resident and not kind_of(t).in_device_memory]


class DeferredSteps:
    """``config``: an ``OffloadConfig`` with ``defer_device_wait``; ``rates``: the start-up's, updated with
    the CPU's rate beside the device once a step shows it; ``overlap``: a real device (not the twin);
    ``frozen``: the sides never move from what start-up chose."""

    def __init__(self, subgroups: Sequence[Subgroup], config, rates: UpdateRates, overlap: bool, frozen: bool = False):
        self.config, self.subgroups, self.rates, self.overlap = config, list(subgroups), rates, overlap
        self.frozen = frozen
        self._cpu_rates: List[float] = []  # the CPU's rate beside the device in the last SAMPLES steps with a share
        self.hidden_s = 0.0  # the device's time the next forward hides (known once its compute is)
        self.learnt = False  # a step has shown the CPU's rate beside the device
        self._probing = False  # the sides hold the probe's share until a step has run with them
        self._probed = False

    @property
    def learns(self) -> bool:
        """Whether the steps time the CPU here: on a device, the share not given, rates measured side by side,
        not ``frozen``."""
        return (not self.frozen and self.overlap and self.config.update_on == "auto"
                and self.config.cpu_share_subgroups == "auto"
                and bool(self.rates.device_streamed and self.rates.streamed_shared))

    def sides(self, tier_of: Sequence[str]) -> Optional[Tuple[List[str], OverlapChoice]]:
        """The sides for ``tier_of`` at the rates and forward known now (None: ``split_updates`` decides)."""
        split = deferred_split(self.config, self.subgroups, tier_of, self.rates, self.hidden_s, self.overlap)
        if split is None or not self._probing:
            return split
        sides, choice = split
        host = host_resident(tier_of)
        on_cpu = set(spread(host, min(PROBE_SUBGROUPS, len(host))))
        return [CPU if i in on_cpu else (DEVICE if i in host else s) for i, s in enumerate(sides)], choice

    def hide(self, hidden_s: float, tier_of: Sequence[str]) -> Optional[Tuple[List[str], str]]:
        """The forward hides ``hidden_s`` of the device's work from now: the sides and their line, or
        None where nothing is deferred here (or the sides are ``frozen``)."""
        if self.frozen:
            return None
        self.hidden_s = max(0.0, hidden_s)
        split = self.sides(tier_of)
        if split is None:
            return None
        return split[0], split[1].describe(self.rates, self.hidden_s)

    def observe(self, rec, tier_of: Sequence[str], current: Sequence[str]) -> Optional[Tuple[List[str], str]]:
        """After a step (``rec``, a ``StepRecord``) run with ``current``: new sides and the line that
        says why, or None to keep them."""
        if not self.learns or rec.skipped or rec.cpu_updated != list(current).count(CPU):
            return None
        host = host_resident(tier_of)
        cpu = [i for i, s in enumerate(current) if s == CPU]
        cpu_s = rec.adam_s + rec.convert_s + rec.callback_s
        streams = any(s == DEVICE and not kind_of(t).in_device_memory for s, t in zip(current, tier_of))
        if cpu and streams and cpu_s > 0:
            self._cpu_rates = (self._cpu_rates + [sum(self.subgroups[i].numel for i in cpu) / cpu_s])[-SAMPLES:]
            self.rates = dataclasses.replace(self.rates, cpu_shared=statistics.median(self._cpu_rates))
            first, self.learnt, self._probing = not self.learnt, True, False
            split = self.sides(tier_of)
            if split is None or split[0] == list(current):
                return None
            sides, choice = split
            now = sum(1 for i in host if current[i] == CPU)
            margin = max(GAIN, NOISE_Z * relative_noise({0: self._cpu_rates}))
            if not first and not choice.seconds[choice.count] < (1 - margin) * choice.seconds[min(now, len(host))]:
                return None
            return sides, (f"{choice.describe(self.rates, self.hidden_s)}; the CPU's rate beside the device "
                           f"from the step ({now} on the cpu)")
        if not self.learnt and not self._probed and host and not cpu and self._could_win(tier_of):
            self._probed = self._probing = True
            sides, _ = self.sides(tier_of)
            return sides, (f"update split under the overlap: cpu {min(PROBE_SUBGROUPS, len(host))} of {len(host)} "
                           f"host-held subgroups for one step, to time the CPU beside the streaming device (the "
                           f"start-up probe's {self.rates.cpu_rate(True) / 1e9:.3g} G elem/s gives it none)")
        return None

    def _could_win(self, tier_of: Sequence[str]) -> bool:
        """Whether the CPU would get a share were it as fast beside the device as alone (else no step
        is spent timing it)."""
        optimistic = dataclasses.replace(self.rates, cpu_shared=self.rates.cpu)
        split = deferred_split(self.config, self.subgroups, tier_of, optimistic, self.hidden_s, self.overlap)
        return split is not None and split[1].count > 0
