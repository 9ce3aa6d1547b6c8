"""The CPU's share of the host-held subgroups under ``defer_device_wait`` (the update under the next
forward): how many of the subgroups resident in host memory the CPU updates, priced by what the
iteration sees of the update rather than by the update's own length.

How a deferred step runs: the device starts on its share (state in device memory, host state streamed
through it) when the step begins and goes on under the next forward; the CPU's share runs inside the
step, which returns when the CPU is done. The next forward starts then; its layers wait for their
params, so the device's work is hidden up to the first micro-batch's forward (``hidden_s``) and the
rest of it holds the forward up. The iteration's share of the update (its "visible" update) is

    max(CPU end, device work in device memory, device end - hidden_s)

(the device's work on state in device memory runs on the forward's HBM and SMs and lengthens it by its
own time: ``prediction.predict_iteration``; without a CPU share this is that function's figure).
Both sides run at their rates measured beside each other (they share host memory bandwidth, and the
host link: the device's streamed state and the CPU's grads and params cross it) until the first one
ends; the other goes on at its rate alone. Where a part of the device's share is waited for inside
the step (state streamed from file tiers), it is counted with the device's share: the forward cannot
start before it either way.

On the CPU twin (the "device" is the CPU's own cores) nothing runs at once: the CPU's share runs in
the step, the device's in the next forward, and the forward hides none of it: the sum is visible.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import List, Optional, Sequence, Tuple

from ..subgroups.partition import Subgroup
from ..tiers.kinds import kind_of
from .placement import CPU, DEVICE, UpdateRates, split_updates, spread
from .split import SideRates


ROUNDING = 1e-9  # predictions this close (relatively) are a tie: float rounding, not a gain


@dataclass(frozen=True)
class SideWork:
    """Elements each side updates: the CPU's, the device's streamed from host (or file) state, and the
    device's on state held in device memory."""
    cpu: int = 0
    streamed: int = 0
    in_device_memory: int = 0


@dataclass(frozen=True)
class OverlapTimes:
    """Seconds from the step's start: when the CPU's share ends, when the device's ends, and the
    update as the iteration sees it (``visible_s``)."""
    cpu_s: float
    device_s: float
    visible_s: float


def _ends_beside(cpu_beside_s: float, cpu_alone_s: float, device_beside_s: float,
                 device_alone_s: float) -> tuple:
    """(CPU end, device end) where both start together at their rates beside each other and the one
    left runs on alone: what it had left, as a fraction of its work, at its rate alone."""
    if not cpu_beside_s or not device_beside_s:
        return cpu_alone_s, device_alone_s
    if cpu_beside_s <= device_beside_s:
        return cpu_beside_s, cpu_beside_s + (1 - cpu_beside_s / device_beside_s) * device_alone_s
    return device_beside_s + (1 - device_beside_s / cpu_beside_s) * cpu_alone_s, device_beside_s


def overlapped_times(work: SideWork, rates: SideRates, hidden_s: float, overlap: bool = True) -> OverlapTimes:
    """The deferred step's times with ``work`` split as given (module docstring). ``hidden_s``: the
    device's time the next forward hides (its first micro-batch's forward); ``overlap``: False on
    the CPU twin (one after the other, nothing hidden)."""
    hbm_s = work.in_device_memory / rates.resident if work.in_device_memory and rates.resident else 0.0
    cpu_alone = work.cpu / rates.cpu_alone if work.cpu else 0.0
    device_alone = hbm_s + (work.streamed / rates.streamed_alone if work.streamed else 0.0)
    if not overlap:
        return OverlapTimes(cpu_alone, cpu_alone + device_alone, cpu_alone + device_alone)
    # Beside the CPU only the streamed part slows (the host link and host memory are shared).
    cpu_beside = work.cpu / rates.cpu_beside if work.cpu and work.streamed else 0.0
    device_beside = hbm_s + work.streamed / rates.streamed_beside if work.cpu and work.streamed else 0.0
    cpu_s, device_s = _ends_beside(cpu_beside, cpu_alone, device_beside, device_alone)
    return OverlapTimes(cpu_s, device_s, max(cpu_s, hbm_s, device_s - hidden_s))


@dataclass(frozen=True)
class OverlapChoice:
    """The CPU's count of the host-resident subgroups and each count's visible update (0..n)."""
    count: int
    seconds: List[float]
    forced: bool = False  # the count was given (``cpu_share_subgroups``), not chosen

    def describe(self, update_rates: UpdateRates, hidden_s: float) -> str:
        """One line: the count, its visible update against the device alone's, the rates it was priced at."""
        rates = SideRates.from_start_up(update_rates)
        n, k = len(self.seconds) - 1, self.count
        how = "given" if self.forced else "chosen"
        return (f"update split under the overlap: cpu {k} of {n} host-held subgroups ({how}): visible update "
                f"predicted {self.seconds[k]:.3f} s vs {self.seconds[0]:.3f} s with the device alone (cpu "
                f"{rates.cpu_beside / 1e9:.3g} G elem/s beside the device, {rates.cpu_alone / 1e9:.3g} alone; "
                f"device streams {rates.streamed_beside / 1e9:.3g} beside, {rates.streamed_alone / 1e9:.3g} "
                f"alone; {hidden_s:.3f} s hidden under the forward)")


def cpu_elements(sizes: Sequence[int], count: int) -> int:
    """Elements of the ``count`` subgroups of ``sizes`` the CPU takes (``placement.spread``'s pick)."""
    return sum(sizes[j] for j in spread(range(len(sizes)), count))


def choose_overlapped_count(sizes: Sequence[int], fixed: SideWork, rates: SideRates, hidden_s: float,
                            overlap: bool = True, side_by_side: bool = True,
                            forced: Optional[int] = None) -> OverlapChoice:
    """How many of the host-resident subgroups of ``sizes`` the CPU updates (the rest streamed through
    the device), beside the work ``fixed`` elsewhere (file-tier subgroups already sided, state in
    device memory). The least visible update wins, ties (to float rounding, ``ROUNDING``) to the fewer
    on the CPU: the CPU gets a share exactly where it is predicted shorter. ``side_by_side``: the
    beside rates were measured; without them only the single sides are priced (nothing credits a
    split with rates never seen together). ``forced``: that count (at most all of them) whatever
    the prediction."""
    n = len(sizes)
    total = sum(sizes)
    seconds = []
    for k in range(n + 1):
        on_cpu = cpu_elements(sizes, k)
        work = SideWork(fixed.cpu + on_cpu, fixed.streamed + total - on_cpu, fixed.in_device_memory)
        seconds.append(overlapped_times(work, rates, hidden_s, overlap).visible_s)
    if forced is not None:
        return OverlapChoice(min(forced, n), seconds, forced=True)
    # The CPU twin's sum is linear in the share: one side or the other (a split differs by rounding).
    counts = range(n + 1) if side_by_side and overlap else sorted({0, n})
    least = min(seconds[k] for k in counts)
    return OverlapChoice(min(k for k in counts if seconds[k] <= least * (1 + ROUNDING)), seconds)


def overlapped_sides(subgroups: Sequence[Subgroup], tier_of: Sequence[str], rates: UpdateRates, hidden_s: float,
                     overlap: bool, forced: Optional[int] = None) -> Tuple[List[str], OverlapChoice]:
    """Each subgroup's update side under ``defer_device_wait`` with ``update_on`` "auto": those in
    device memory on the device, those on file tiers as ``placement.split_updates`` sides them (the
    step waits for them either way), and of those resident in host memory the CPU's count from
    ``choose_overlapped_count`` (spread over the order), the rest streamed through the device."""
    sides = split_updates(subgroups, tier_of, "auto", rates, deferred=True)
    host = [i for i, t in enumerate(tier_of) if kind_of(t).resident and not kind_of(t).in_device_memory]
    host_set = set(host)
    others = [i for i in range(len(tier_of)) if i not in host_set]
    fixed = SideWork(cpu=sum(subgroups[i].numel for i in others if sides[i] == CPU),
                     streamed=sum(subgroups[i].numel for i in others
                                  if sides[i] == DEVICE and not kind_of(tier_of[i]).in_device_memory),
                     in_device_memory=sum(subgroups[i].numel for i in others if kind_of(tier_of[i]).in_device_memory))
    side_by_side = bool(rates.cpu_shared and rates.streamed_shared)
    choice = choose_overlapped_count([subgroups[i].numel for i in host], fixed, SideRates.from_start_up(rates),
                                     hidden_s, overlap, side_by_side, forced)
    on_cpu = set(spread(host, choice.count))
    for i in host:
        sides[i] = CPU if i in on_cpu else DEVICE
    return sides, choice


def deferred_split(config, subgroups: Sequence[Subgroup], tier_of: Sequence[str], rates: Optional[UpdateRates],
                   hidden_s: float, overlap: bool) -> Optional[Tuple[List[str], OverlapChoice]]:
    """``overlapped_sides`` where ``config`` (an ``OffloadConfig``) defers the device's wait with
    ``update_on`` "auto" and the device's streamed rate is known; None elsewhere (``split_updates``
    decides alone)."""
    if not (config.defer_device_wait and config.update_on == "auto" and rates is not None and rates.device_streamed):
        return None
    share = config.cpu_share_subgroups
    return overlapped_sides(subgroups, tier_of, rates, hidden_s, overlap,
                            None if share == "auto" else (share or 0))  # default: none (measured, see the config)
