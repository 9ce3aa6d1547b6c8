"""The update split re-measured from the steps themselves: how many of the host-held subgroups the
CPU updates while the device streams the rest (``update_on`` "auto").

The start-up split comes from rates probed once (``UpdateRates``). Real steps can differ: beside the
streaming GPU the CPU can run far below its probe, and its few subgroups then make the update slower
than the GPU alone (docs/design.md, "Placement"). Here each step's record gives the rate each side
achieved; the split is then re-chosen to minimise the predicted update, max(CPU share, device share),
over every count, and never kept or chosen slower than the better single side (all host-held
subgroups on the device, or all on the CPU).

How a record is read: the CPU's share is its own time (adam + conversion + params out). The
device's busy time is not in the record: beside the CPU it is taken as the whole step less the
read waits, which is exact when the device finishes last and errs towards a slower device
otherwise, so a split the model picks never looks better than the step that measured it. On the
CPU twin the two sides run one after the other on the same cores: there the device's time is the
rest of the step, the two shares add up, and a side's rate alone and beside the other are one.

Settling: steps are noisy (a quickstart-sized update takes milliseconds and varies by tens of per
cent), so nothing is decided on one step's figures. Each count keeps its last ``SAMPLES`` measured
updates (less read waits) and is priced by their median, never below its prediction (a count
measured slower is not tried again); a count never measured is priced by its prediction, as much
slower as the counts moved to turned out against what was predicted for them. The rates come from
the median step at the current count, on top of the rates the split arrived with. The noise is the
steps' pooled relative spread (``relative_noise``; ``NOISE_PRIOR`` until steps show one), at least
``JITTER_S`` of the current count's time. A move must gain more than ``NOISE_Z`` times the noise; a
split slower than the better single side (all host-held subgroups on the device, or all on the CPU)
by that much is left at once, a move for a gain also needs ``GAIN`` on two steps in a row. The first
``warmup_steps`` records only count. ``frozen`` (deterministic runs): the split never moves.
"""

from __future__ import annotations

import dataclasses
import math
import statistics
from dataclasses import dataclass
from typing import Dict, List, Mapping, Optional, Sequence, Tuple

from ..tiers.kinds import kind_of
from .device_share import device_share_seconds, streamed_seconds_within
from .placement import CPU, DEVICE, UpdateRates, spread

GAIN = 0.03  # a move must be predicted to shorten the update by more than this fraction
# The relative standard deviation of a step's update assumed until steps at one count show their own (it weighs as
# one degree of freedom against theirs): a first step slower than the better single side by NOISE_Z times this
# (15%) leaves at once.
NOISE_PRIOR = 0.05
# A step's timing jitter whatever its length (the host's scheduling, the device's synchronisation): the noise of
# a short step (the quickstart's update takes milliseconds) is at least this.
JITTER_S = 0.5e-3
NOISE_Z = 3.0  # a move must be predicted to gain more than this many of the steps' standard deviations
SAMPLES = 8  # the recent steps kept per count: their median prices it, their spread is the noise
# The device's rate beside the CPU rises above what it knew only from a step where the CPU worked at least this
# share of it: beside a short CPU share the device streams mostly alone, and a rate read there once moved the split
# to a large CPU share that it left a step later, that step slower (docs/design.md,
# "Placement"). A lower figure counts from any step: the CPU's share only slows it.
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


@dataclass(frozen=True)
class Bar:
    """What a move must clear: ``gain``, the fraction a move for a gain must shorten the update by;
    ``margin``, the steps' noise as a fraction of the current split's time, which every move must
    exceed; ``missed``, the fraction by which a count never measured is priced over its prediction."""
    gain: float = GAIN
    margin: float = 0.0
    missed: float = 0.0


def choose_split(current: int, sizes: Sequence[int], resident_elems: int, rates: SideRates,
                 measured: Optional[Dict[int, float]] = None, overlap: bool = True, bar: Bar = Bar()) -> Choice:
    """The CPU's count of host-held subgroups after a step at ``current``. Each count is judged by
    its predicted update, or by its ``measured`` one where that was slower; a count never measured
    by its prediction ``bar.missed`` slower. The best count wins where ``current`` is slower than the
    better single side (0: the device alone; n: the CPU for all of them) by more than ``bar.margin``,
    or where it gains more than ``bar.gain`` and ``bar.margin``; otherwise ``current`` stays."""
    gain, margin, missed = bar.gain, bar.margin, bar.missed
    n = len(sizes)
    measured = measured or {}
    predicted = [split_times(k, sizes, resident_elems, rates, overlap)[2] for k in range(n + 1)]
    seconds = [max(p, measured[k]) if k in measured else p * (1 + missed) for k, p in enumerate(predicted)]
    best = min(range(n + 1), key=lambda k: (seconds[k], k != current, k))
    single = min(seconds[0], seconds[n])
    if single < (1 - margin) * seconds[current]:
        side = "the device alone" if seconds[0] <= seconds[n] else "the cpu alone"
        return Choice(best, seconds, f"{'the split' if 0 < current < n else 'it'} is slower than {side}", True)
    if seconds[best] < (1 - max(gain, margin)) * seconds[current]:
        return Choice(best, seconds, f"predicted {1 - seconds[best] / seconds[current]:.0%} faster")
    return Choice(current, seconds)


def relative_noise(times: Mapping[int, Sequence[float]], prior: float = NOISE_PRIOR) -> float:
    """The relative standard deviation of a step's time: pooled over the counts of ``times`` (each
    count's measured seconds, about their mean), ``prior`` weighing as one more degree of freedom."""
    squares, dof = prior ** 2, 1
    for seen in times.values():
        mean = sum(seen) / len(seen)
        if len(seen) > 1 and mean > 0:
            squares += sum((t / mean - 1) ** 2 for t in seen)
            dof += len(seen) - 1
    return math.sqrt(squares / dof)


@dataclass(frozen=True)
class StepSeconds:
    """What one step's record says of its time: the whole update, its waits for reads, the CPU's share."""
    update_s: float
    read_wait_s: float
    cpu_s: float

    @property
    def measured_s(self) -> float:
        """The update less its read waits: what a count is priced by."""
        return self.update_s - self.read_wait_s

    @classmethod
    def median(cls, steps: Sequence["StepSeconds"]) -> "StepSeconds":
        """Each figure's median over ``steps``: a typical step, one noisy step left out."""
        return cls(*(statistics.median(getattr(s, f.name) for s in steps) for f in dataclasses.fields(cls)))


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
    """Fed each step's record (``observe``); says when and how the split should change. ``frozen``:
    never (the steps' timings leave the split as start-up chose it)."""

    def __init__(self, rates: SideRates, overlap: bool = True, gain: float = GAIN, warmup_steps: int = 1,
                 memory_steps: int = 100, frozen: bool = False):
        self.rates, self.overlap, self.gain = rates, overlap, gain
        self.warmup_steps, self.memory_steps, self.frozen = warmup_steps, memory_steps, frozen
        self.learnt = False  # whether any step has been measured
        self._seen = 0
        self._steps: Dict[int, List[Tuple[int, StepSeconds]]] = {}  # count -> its last SAMPLES (step, seconds)
        self._arrived: Optional[Tuple[int, SideRates]] = None  # the current count and the rates it started from
        self._promised: Dict[int, float] = {}  # count moved to -> the update it was predicted to take there
        self._layout: Optional[Tuple[str, ...]] = None
        self._proposed: Optional[int] = None  # a count the last step found worth moving to

    def observe(self, rec, numels: Sequence[int], tier_of: Sequence[str],
                sides: Sequence[str]) -> Optional[Tuple[List[str], str]]:
        """After a step (``rec``, a ``StepRecord``) run with ``sides``: the new sides and the line
        that says why, or None to keep them. The first ``warmup_steps`` records only count."""
        if self.frozen or rec.skipped or rec.update_s <= 0:
            return None
        self._seen += 1
        held = [i for i, t in enumerate(tier_of) if not kind_of(t).in_device_memory]
        count = sum(sides[i] == CPU for i in held)
        if self._seen <= self.warmup_steps or not held or rec.cpu_updated != count:
            return None
        if tuple(tier_of) != self._layout:  # subgroups moved between tiers: earlier times are of another set
            self._layout, self._steps, self._promised = tuple(tier_of), {}, {}
            self._proposed = self._arrived = None
        if self._arrived is None or self._arrived[0] != count:
            self._arrived = (count, self.rates)
        sizes = [numels[i] for i in held]
        resident = sum(numels[i] for i, t in enumerate(tier_of) if kind_of(t).in_device_memory)
        cpu_elems = sum(numels[i] for i in held if sides[i] == CPU)
        self._remember(count, rec.step, StepSeconds(rec.update_s, rec.read_wait_s,
                                                    rec.adam_s + rec.convert_s + rec.callback_s))
        # The rates of the median step here, on top of those the count started from: one noisy step moves neither.
        typical = StepSeconds.median([seconds for _, seconds in self._steps[count]])
        self.rates = observed_rates(self._arrived[1], cpu_elems, sum(sizes) - cpu_elems, resident, typical,
                                    self.overlap)
        self.learnt = True
        priced = self._choose(count, sizes, resident)
        if priced is None:
            return None
        choice, noise = priced
        # A move for a gain waits for a second step to agree (one noisy step does not move it); a
        # split slower than a single side is left at once.
        confirmed = choice.forced or choice.count == self._proposed
        self._proposed = choice.count if choice.count != count and not confirmed else None
        if choice.count == count or not confirmed:
            return None
        self._promised[choice.count] = choice.seconds[choice.count]
        return sides_for(tier_of, choice.count), self.describe(count, choice, len(held), noise)

    def _choose(self, count: int, sizes: Sequence[int], resident: int) -> Optional[Tuple[Choice, float]]:
        """``choose_split`` from ``count`` at the rates and the counts' median times known now, and the
        steps' noise it was judged by; None where the current count's steps show no time to price."""
        times = {k: [seconds.measured_s for _, seconds in steps] for k, steps in self._steps.items()}
        medians = {k: statistics.median(seen) for k, seen in times.items()}
        if medians[count] <= 0:  # its steps only waited for reads
            return None
        # How much slower than promised the counts moved to turned out: an untried count is priced that much worse.
        missed = max([medians[k] / p - 1 for k, p in self._promised.items() if k in medians and p > 0] + [0.0])
        noise = max(relative_noise(times), JITTER_S / medians[count])
        return choose_split(count, sizes, resident, self.rates, medians, self.overlap,
                            Bar(self.gain, NOISE_Z * noise, missed)), noise

    def _remember(self, count: int, step: int, seconds: StepSeconds) -> None:
        """Keep ``seconds`` among ``count``'s last ``SAMPLES``; forget steps over ``memory_steps`` old."""
        self._steps[count] = (self._steps.get(count, []) + [(step, seconds)])[-SAMPLES:]
        recent = {k: [(s, t) for s, t in steps if step - s < self.memory_steps] for k, steps in self._steps.items()}
        self._steps = {k: steps for k, steps in recent.items() if steps}

    def plan(self, numels: Sequence[int], tier_of: Sequence[str]) -> List[str]:
        """Sides for a new layout (subgroups moved between tiers), at the rates measured so far."""
        held = [i for i, t in enumerate(tier_of) if not kind_of(t).in_device_memory]
        resident = sum(numels[i] for i, t in enumerate(tier_of) if kind_of(t).in_device_memory)
        sizes = [numels[i] for i in held]
        seconds = [split_times(k, sizes, resident, self.rates, self.overlap)[2] for k in range(len(held) + 1)]
        return sides_for(tier_of, min(range(len(seconds)), key=lambda k: (seconds[k], k)))

    def describe(self, old: int, choice: Choice, held: int, noise: float) -> str:
        """The line that says why the split moves (``noise``: the steps' relative standard deviation)."""
        r, new = self.rates, choice.count

        def name(k):
            return "device-only" if k == 0 else "cpu-only" if k == held else f"split ({k} on cpu)"
        return (f"update split: cpu {old} -> {new} of {held} host-held subgroups ({choice.why}): cpu "
                f"{r.cpu_beside / 1e9:.3g} G elem/s beside the device ({r.cpu_alone / 1e9:.3g} alone), device "
                f"streams {r.streamed_beside / 1e9:.3g} beside the cpu ({r.streamed_alone / 1e9:.3g} alone); "
                f"{name(new)} update predicted {_secs(choice.seconds[new])} vs "
                f"{name(old)} {_secs(choice.seconds[old])} (the steps vary by {noise:.0%})")


def _secs(seconds: float) -> str:
    return f"{seconds:.3g} s" if seconds >= 0.1 else f"{seconds * 1e3:.3g} ms"
