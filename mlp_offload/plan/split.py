"""The update split re-measured from the steps themselves: how many of the host-held subgroups the
CPU updates while the device streams the rest (``update_on`` "auto").

The start-up split comes from rates probed once (``UpdateRates``). Real steps can differ: on a
20.68 B model on one H200 the CPU ran at 0.22 G elem/s beside the streaming GPU, far below its
probe, and its 5 subgroups made the update ~0.7 s slower than the GPU alone. Here each step's
record gives the rate each side achieved; the split is then re-chosen to minimise the predicted
update, max(CPU share, device share), over every count, and never kept or chosen slower than the
better single side (all host-held subgroups on the device, or all on the CPU).

How a record is read: the CPU's share is its own time (adam + conversion + params out). The
device's busy time is not in the record: beside the CPU it is taken as the whole step less the
read waits, which is exact when the device finishes last and errs towards a slower device
otherwise, so a split the model picks never looks better than the step that measured it. On the
CPU twin the two sides run one after the other on the same cores: there the device's time is the
rest of the step, the two shares add up, and a side's rate alone and beside the other are one.

Hysteresis: a split is moved at most once per step, and only where the prediction gains over 3%
on two steps in a row, or at once where the current split is slower than the better single side
(predicted at the measured rates: the current split at its measured time). Every split measured
in the last ``memory_steps`` steps is priced at no less than its measured time, so a move that
turned out slower is not tried again (no flapping between two splits).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Dict, List, Optional, Sequence, Tuple

from ..tiers.kinds import kind_of
from .device_share import device_share_seconds, streamed_seconds_within
from .placement import CPU, DEVICE, UpdateRates, spread

GAIN = 0.03  # a move must be predicted to shorten the update by more than this fraction
# The device's rate beside the CPU rises above what it knew only from a step where the CPU worked at least this
# share of it: beside a short CPU share the device streams mostly alone (20.68 B and 25.36 B with fp8 moments on an
# H200, 2026-11-28: 8.4-11 G elem/s "beside" one CPU subgroup, then 4.2-7.6 beside 11-17 of them, which the split
# had moved to on the first figure and moved back from a step later, that step 30-40% slower). A lower figure
# counts from any step: the CPU's share only slows it.
BESIDE_SHARE = 0.5


@dataclass
class SideRates:
    """Elements per second of each side, alone and beside the other (the latest measured, else start-up's)."""

    cpu_alone: float  # the CPU's share while the device streams nothing
    cpu_beside: float  # ... while the device streams host state
    streamed_alone: float  # host state streamed through the device, the CPU idle
    streamed_beside: float  # ... while the CPU updates its share
    resident: Optional[float] = None  # device Adam on state held in device memory
    # The device's in-HBM updates run beside its streaming (``device_share``: the engine interleaves them;
    # the config's interleave_device_updates), where the sides overlap at all
    interleaved: bool = True

    @classmethod
    def from_start_up(cls, rates: UpdateRates, interleaved: bool = True) -> "SideRates":
        return cls(rates.cpu, rates.cpu_rate(device_streams=True), rates.device_streamed,
                   rates.streamed_rate(cpu_works=True), rates.device_resident, interleaved)

    def as_update_rates(self) -> UpdateRates:
        return UpdateRates(cpu=self.cpu_alone, device_resident=self.resident, device_streamed=self.streamed_alone,
                           cpu_shared=self.cpu_beside, streamed_shared=self.streamed_beside)


def sides_for(tier_of: Sequence[str], count: int) -> List[str]:
    """Device-resident subgroups on the device; ``count`` of the host-held ones, spread evenly over
    the order, on the CPU; the rest streamed through the device."""
    held = [i for i, t in enumerate(tier_of) if not kind_of(t).in_device_memory]
    cpu = set(spread(held, count))
    return [CPU if i in cpu else DEVICE for i in range(len(tier_of))]


def split_times(count: int, sizes: Sequence[int], resident_elems: int, rates: SideRates,
                overlap: bool = True) -> Tuple[float, float, float]:
    """(CPU share, device share, update) seconds predicted where the CPU updates ``count`` of the
    host-held subgroups of ``sizes`` (the ones ``sides_for`` picks) and the device the rest, plus
    ``resident_elems`` elements held in device memory. ``overlap``: the sides run at once (the
    update takes the longer share); else one after the other (the CPU twin)."""
    on_cpu = set(spread(range(len(sizes)), count))
    cpu_elems = sum(sizes[j] for j in on_cpu)
    streamed = sum(sizes) - cpu_elems
    cpu_s = cpu_elems / (rates.cpu_beside if streamed else rates.cpu_alone) if cpu_elems else 0.0
    device_s = device_share_seconds(resident_elems, streamed, rates.resident,
                                    rates.streamed_beside if cpu_elems else rates.streamed_alone,
                                    overlap and rates.interleaved)
    return cpu_s, device_s, (max(cpu_s, device_s) if overlap else cpu_s + device_s)


def settled_sides(numels: Sequence[int], tier_of: Sequence[str], rates: UpdateRates,
                  interleaved: bool = True) -> List[str]:
    """The split the steps settle on where they show ``rates``: the CPU's count of host-held
    subgroups with the least predicted update (``split_times``), as ``choose_split`` and
    ``UpdateSplit.plan`` pick it. Without rates measured side by side only the single sides (all
    host-held subgroups on the device, or all on the CPU) are priced: a split is credited only
    with rates measured beside each other (the steps move it back where it loses)."""
    held = [i for i, t in enumerate(tier_of) if not kind_of(t).in_device_memory]
    sizes = [numels[i] for i in held]
    resident = sum(numels[i] for i, t in enumerate(tier_of) if kind_of(t).in_device_memory)
    side = SideRates.from_start_up(rates, interleaved)
    counts = range(len(held) + 1) if rates.cpu_shared and rates.streamed_shared else sorted({0, len(held)})
    best = min(counts, key=lambda k: (split_times(k, sizes, resident, side)[2], k))
    return sides_for(tier_of, best)


@dataclass
class Choice:
    count: int  # CPU subgroups chosen
    seconds: List[float]  # per count 0..n: the update time it was judged by
    why: str = ""  # why it moved ("" where it stays)
    forced: bool = False  # moved because ``current`` was slower than a single side (not for a gain)


def choose_split(current: int, sizes: Sequence[int], resident_elems: int, rates: SideRates,
                 measured: Optional[Dict[int, float]] = None, gain: float = GAIN, overlap: bool = True) -> Choice:
    """The CPU's count of host-held subgroups after a step at ``current``. Each count is judged by
    its predicted update, or by its ``measured`` one where that was slower. The best count wins
    where ``current`` is slower than the better single side (0: the device alone; n: the CPU for
    all of them), or where it gains more than ``gain``; otherwise ``current`` stays."""
    n = len(sizes)
    measured = measured or {}
    seconds = [max(split_times(k, sizes, resident_elems, rates, overlap)[2], measured.get(k, 0.0))
               for k in range(n + 1)]
    best = min(range(n + 1), key=lambda k: (seconds[k], k != current, k))
    single = min(seconds[0], seconds[n])
    if seconds[current] > single:
        side = "the device alone" if seconds[0] <= seconds[n] else "the cpu alone"
        return Choice(best, seconds, f"{'the split' if 0 < current < n else 'it'} is slower than {side}", True)
    if seconds[best] < (1 - gain) * seconds[current]:
        return Choice(best, seconds, f"predicted {1 - seconds[best] / seconds[current]:.0%} faster")
    return Choice(current, seconds)


@dataclass(frozen=True)
class StepSeconds:
    """What one step's record says of its time: the whole update, its waits for reads, the CPU's share."""
    update_s: float
    read_wait_s: float
    cpu_s: float


def observed_rates(prior: SideRates, cpu_elems: int, streamed_elems: int, resident_elems: int, seconds: StepSeconds,
                   overlap: bool = True) -> SideRates:
    """``prior`` with the rates one step showed: the CPU's from its own time ``seconds.cpu_s``; the
    device's streamed rate from the step's time less read waits (less the CPU's share where the
    sides ran one after the other), its in-HBM share taken out as ``device_share`` models it; its
    rate beside the CPU raised only where the CPU worked ``BESIDE_SHARE`` of the step or more."""
    rates = dataclasses.replace(prior)
    cpu_s = seconds.cpu_s
    compute_s = seconds.update_s - seconds.read_wait_s
    # Where the sides do not overlap (the CPU twin), "alone" and "beside" are the same rate.
    if cpu_elems and cpu_s > 0:
        if streamed_elems or not overlap:
            rates.cpu_beside = cpu_elems / cpu_s
        if not streamed_elems or not overlap:
            rates.cpu_alone = cpu_elems / cpu_s
    if streamed_elems:
        device_s = streamed_seconds_within(compute_s - (0.0 if overlap else cpu_s), resident_elems, streamed_elems,
                                           prior.resident, overlap and prior.interleaved)
        if device_s:
            beside = streamed_elems / device_s
            if not overlap or (cpu_elems and (beside < prior.streamed_beside or cpu_s >= BESIDE_SHARE * compute_s)):
                rates.streamed_beside = beside
            if not cpu_elems or not overlap:
                rates.streamed_alone = streamed_elems / device_s
    return rates


class UpdateSplit:
    """Fed each step's record (``observe``); says when and how the split should change."""

    def __init__(self, rates: SideRates, overlap: bool = True, gain: float = GAIN, warmup_steps: int = 1,
                 memory_steps: int = 100):
        self.rates, self.overlap, self.gain = rates, overlap, gain
        self.warmup_steps, self.memory_steps = warmup_steps, memory_steps
        self.learnt = False  # whether any step has been measured
        self._seen = 0
        self._measured: Dict[int, Tuple[int, float]] = {}  # count -> (step, measured update less read waits)
        self._layout: Optional[Tuple[str, ...]] = None
        self._proposed: Optional[int] = None  # a count the last step found worth moving to

    def observe(self, rec, numels: Sequence[int], tier_of: Sequence[str],
                sides: Sequence[str]) -> Optional[Tuple[List[str], str]]:
        """After a step (``rec``, a ``StepRecord``) run with ``sides``: the new sides and the line
        that says why, or None to keep them. The first ``warmup_steps`` records only count."""
        if rec.skipped or rec.update_s <= 0:
            return None
        self._seen += 1
        held = [i for i, t in enumerate(tier_of) if not kind_of(t).in_device_memory]
        count = sum(sides[i] == CPU for i in held)
        if self._seen <= self.warmup_steps or not held or rec.cpu_updated != count:
            return None
        if tuple(tier_of) != self._layout:  # subgroups moved between tiers: earlier times are of another set
            self._layout, self._measured, self._proposed = tuple(tier_of), {}, None
        sizes = [numels[i] for i in held]
        resident = sum(numels[i] for i, t in enumerate(tier_of) if kind_of(t).in_device_memory)
        cpu_elems = sum(numels[i] for i in held if sides[i] == CPU)
        seconds = StepSeconds(rec.update_s, rec.read_wait_s, rec.adam_s + rec.convert_s + rec.callback_s)
        self.rates = observed_rates(self.rates, cpu_elems, sum(sizes) - cpu_elems, resident, seconds, self.overlap)
        self.learnt = True
        self._measured[count] = (rec.step, rec.update_s - rec.read_wait_s)
        self._measured = {k: v for k, v in self._measured.items() if rec.step - v[0] < self.memory_steps}
        choice = choose_split(count, sizes, resident, self.rates, {k: s for k, (_, s) in self._measured.items()},
                              self.gain, self.overlap)
        # A move for a gain waits for a second step to agree (one noisy step does not move it); a
        # split slower than a single side is left at once.
        confirmed = choice.forced or choice.count == self._proposed
        self._proposed = choice.count if choice.count != count and not confirmed else None
        if choice.count == count or not confirmed:
            return None
        return sides_for(tier_of, choice.count), self.describe(count, choice, len(held))

    def plan(self, numels: Sequence[int], tier_of: Sequence[str]) -> List[str]:
        """Sides for a new layout (subgroups moved between tiers), at the rates measured so far."""
        held = [i for i, t in enumerate(tier_of) if not kind_of(t).in_device_memory]
        resident = sum(numels[i] for i, t in enumerate(tier_of) if kind_of(t).in_device_memory)
        sizes = [numels[i] for i in held]
        seconds = [split_times(k, sizes, resident, self.rates, self.overlap)[2] for k in range(len(held) + 1)]
        return sides_for(tier_of, min(range(len(seconds)), key=lambda k: (seconds[k], k)))

    def describe(self, old: int, choice: Choice, held: int) -> str:
        r, new = self.rates, choice.count

        def name(k):
            return "device-only" if k == 0 else "cpu-only" if k == held else f"split ({k} on cpu)"
        return (f"update split: cpu {old} -> {new} of {held} host-held subgroups ({choice.why}): cpu "
                f"{r.cpu_beside / 1e9:.3g} G elem/s beside the device ({r.cpu_alone / 1e9:.3g} alone), device "
                f"streams {r.streamed_beside / 1e9:.3g} beside the cpu ({r.streamed_alone / 1e9:.3g} alone); "
                f"{name(new)} update predicted {_secs(choice.seconds[new])} vs "
                f"{name(old)} {_secs(choice.seconds[old])}")


def _secs(seconds: float) -> str:
    return f"{seconds:.3g} s" if seconds >= 0.1 else f"{seconds * 1e3:.3g} ms"
