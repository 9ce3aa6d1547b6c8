"""A background checkpoint writer paced into its disk's idle time (``write.BackgroundStateWrite``).

Where the checkpoint's directory is on the device of a file tier (same ``st_dev``), the writer and the
tier's own step I/O share one disk, and an unpaced writer slows the steps beside it by its whole
traffic. So the writer moves its bytes in bounded chunks (a piece of
``direct_io``, a tier read for the digest), each of which waits while such a tier moves data
(``tiers.activity``): the step's I/O goes first. A tier that is hardly ever quiet must not starve the
writer, so chunks also pass while it is busy, at ``WRITER_SHARE`` of ``CAP_SHARE`` of the disk's write rate (the
rates the steps showed, ``engine.file_tier_rates``; torch_dist's flushes take the other part): the step's I/O keeps
at least ``1 / SLOWDOWN`` of the disk.
The writer must be done before the next save, which otherwise holds training while it finishes: where the caller
says when that is (``next_save_in_s``), the pacer aims to be done by ``FINISH_SHARE`` of it. The tiers' quiet
spells are the forward and backward passes (a step's update keeps its file tiers busy for its whole span:
``TierActivity.window``), so a chunk in one slows no step I/O, and the writer takes them as they come. Beside a
busy tier it moves only what the quiet spells will not carry by the due time: for the first ``CALIBRATE_SHARE``
of that time nothing (it measures what the quiet spells carry; a tier almost never quiet, ``busy_share`` at
least ``NEVER_QUIET``, and updates that wait for the writer, ``spread`` off, get the cap from the start), then,
where the bytes left, less what quiet spells at the rate seen will carry by then, need it, at the rate that has
them done in the tiers' busy time (``DiskPacer.rate_now``). Within that busy time no chunk takes the writer past
the bytes expected spread evenly over ``1 / AHEAD`` of the time (``DiskPacer.spread_bytes``): what must go beside
the steps goes beside each alike.
A writer due earlier on the same disk (torch_dist's paced flushes: ``paced_flush``) goes first: the writer waits
while it runs (``DiskPacer.yield_to_first``), then starts its pacing anew.
A checkpoint on another device: no pacing. Since the writer then takes several steps, the staging
budget (``snapshot``) is raised to the state held in memory while host memory allows, and the writer
copies that state aside before its first chunk: the updates after the save neither copy nor wait.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from typing import Callable, List, Optional, Sequence, Tuple

from ..tiers.host import meminfo_bytes
from .state_file import human_bytes, state_file_bytes

log = logging.getLogger("mlp_offload")

SLOWDOWN = 1.2  # the most a step's I/O may slow by the writers beside it while the tier is busy
CAP_SHARE = 1 - 1 / SLOWDOWN  # of the disk's write rate: the step's I/O keeps 1 / SLOWDOWN of it
# The background writers of an --async-save on one disk: this writer and torch_dist's forked writer's paced
# flushes (paced_flush). They share CAP_SHARE, each taking WRITER_SHARE of it beside a busy tier.
WRITER_SHARE = 1 / 2
POLL_S = 0.005  # how often a waiting chunk looks again
HOST_SHARE = 0.5  # of the host memory available now, the most the staging may take
MIN_CAP_BPS = 50e6  # where no rate is known: the writer still finishes beside a tier never quiet
FINISH_SHARE = 0.9  # of the time to the next save (at the steps' pace before it): when the writers aim to be done
CALIBRATE_SHARE = 0.25  # of the time to the due time: nothing beside a busy tier, the quiet spells' rate measured
CYCLES_SHARE = 0.5  # of the time to the due time: past it, tiers not yet seen quiet are taken never to be
MIN_BUSY_SHARE = 0.05  # the least busy share a raise assumes (a tier seen nearly always quiet)
NEVER_QUIET = 0.95  # a busy share from which the quiet spells cannot be waited for: the cap from the start
# The even spread's pace: the bytes expected over 1 / AHEAD of the time to the due time (1.25: done by 80% of it),
# not over all of it, so a stretch where the tiers leave the writer less room (busier steps, a long one) is made up
# before the due time.
AHEAD = 1.25
FIRST_POLL_S = 0.05  # how often a writer waiting for one due first looks again
FIRST_SHARE = 0.5  # of the time to the due time: the most a writer waits for one due first


class DiskPacer:
    """``wait_turn(nbytes)`` before each chunk: at once while every tier of ``tiers`` is quiet, else
    once the tiers are quiet or ``rate_now()`` has accrued the chunk's bytes (at most one chunk banked).
    ``due_at`` (on ``clock``, which is the same in every process of the machine by default): when the bytes
    ``expect``ed should be moved; no chunk takes the writer past ``spread_bytes`` (the even spread), and past
    ``CALIBRATE_SHARE`` of the time to it the cap rises where the bytes left need it. ``busy_share``: of the
    time, the share the tiers are busy (their recent share; 1.0: never quiet)."""

    def __init__(self, tiers: Sequence, cap_bps: float, clock: Callable[[], float] = time.monotonic,
                 sleep: Callable[[float], None] = time.sleep, due_at: Optional[float] = None,
                 busy_share: float = 1.0):
        self.tiers = list(tiers)
        self.cap_bps = cap_bps
        self.due_at = due_at
        self.busy_share = min(1.0, max(MIN_BUSY_SHARE, busy_share))
        self.started = clock()
        # until then, the cap alone: the steps right after the save pay no raise, the quiet spells are measured
        self.calibrated_at = self.started + CALIBRATE_SHARE * (due_at - self.started) if due_at is not None else None
        self.cycles_by = self._cycles_by()
        self.expected_bytes = 0  # what the writer says it will move through wait_turn (for due_at)
        self.raised_bps = 0.0  # the highest rate the chunks accrued at above the cap (the report)
        self.past_due = False  # chunks went at once, past due_at
        self.spread_until = None  # seconds from the start to when the even spread last held a chunk back (the report)
        self.spread = True  # off where updates wait for the writer (a staging short of the memory-held state)
        self._clock, self._sleep = clock, sleep
        self._lock = threading.Lock()  # the writer's thread and its reads ask in turn
        self._credit, self._credit_at = 0.0, None
        self.idle_bytes = 0  # bytes that went while the tiers were quiet
        self._was_busy = None  # the tiers at the last look (None: no look yet)
        # (when the tiers first and last went quiet after a busy spell, idle_bytes then): the quiet spells' rate is
        # taken over the whole busy-and-quiet cycles between, not from the writer's start (a start in a busy spell,
        # or late in a quiet one, understates it) nor up to the end of a quiet spell (which overstates it)
        self._cycles_first, self._cycles_end = None, None
        self._quiet_s, self._quiet_at = 0.0, None  # the quiet time seen, and when the quiet spell under way began
        self._busy_at, self._busy_s = None, 0.0  # when the busy spell under way began, how long the last one was
        self.capped_bytes = 0  # bytes that went beside the tiers' I/O, at the cap
        self.waited_s = 0.0
        self.waits = 0  # chunks that waited at all
        self.staged_bytes, self.staged_s = 0, 0.0  # the memory-held state copied aside before the first chunk
        # a writer due earlier on this disk: whether it still runs, and when it is due (yield_to_first)
        self.first: Optional[Callable[[], bool]] = None
        self.first_until: Optional[float] = None
        self.yielded_s = 0.0

    def yield_to_first(self, check: Callable[[], None] = lambda: None) -> None:
        """Before the first chunk: nothing moves while the writer due first runs (``first``), up to its due time
        (``first_until``) and ``FIRST_SHARE`` of the time to ``due_at``; ``check`` at each look (a cancel raises).
        Where it waited, the pacing starts anew from its end: the calibration then measures the quiet spells
        this writer has to itself."""
        if self.first is None or not self.spread:  # updates that wait for this writer: it must not wait itself
            return
        begun = self._clock()
        limits = [self.first_until] if self.first_until is not None else []
        if self.due_at is not None:
            limits.append(begun + FIRST_SHARE * (self.due_at - begun))
        until = min(limits) if limits else float("inf")
        while self._clock() < until and self.first():
            check()
            self._sleep(FIRST_POLL_S)
        now = self._clock()
        self.yielded_s = now - begun
        if self.yielded_s <= 0:
            return
        self.started = now
        if self.due_at is not None:
            self.calibrated_at = now + CALIBRATE_SHARE * max(0.0, self.due_at - now)
        self.cycles_by = self._cycles_by()
        self._credit, self._credit_at, self._was_busy = 0.0, None, None
        self._cycles_first, self._cycles_end = None, None
        self._quiet_s, self._quiet_at = 0.0, None

    def _cycles_by(self) -> Optional[float]:
        """When the quiet spells are taken to carry nothing where none has been seen by then."""
        return None if self.due_at is None else self.started + CYCLES_SHARE * max(0.0, self.due_at - self.started)

    def busy(self) -> bool:
        return any(not tier.activity.quiet() for tier in self.tiers)

    def expect(self, nbytes: int) -> None:
        """``nbytes`` more will go through ``wait_turn`` before ``due_at``."""
        self.expected_bytes += nbytes

    def rate_now(self) -> float:
        """Bytes/s a chunk may go at beside a busy tier now: without a due time, ``cap_bps``; up to the
        calibration's end, none; past it, the rate at which the tiers' busy time moves the bytes expected and not
        yet moved, less what the quiet spells carry by ``due_at`` at the rate ``_quiet_bps`` gives (none where they
        carry it all; past ``due_at``: no limit; none while no quiet time has been seen, up to ``cycles_by``). A tier
        almost never quiet, or updates that wait for the writer (``spread`` off): at least the cap."""
        left = self.expected_bytes - self.idle_bytes - self.capped_bytes - self._credit  # the credit will go too
        if self.due_at is None:
            return self.cap_bps  # no due time to measure the quiet spells against: the cap
        # the quiet spells not waited for: a tier almost never quiet, or updates that wait for the writer (holding
        # their tier busy meanwhile)
        floor = self.cap_bps if self.busy_share >= NEVER_QUIET or not self.spread else 0.0
        if left <= 0:
            return floor
        now = self._clock()
        time_left = self.due_at - now
        if time_left <= 0:
            return float("inf")
        if now < self.calibrated_at:
            return floor
        quiet_bps = self._quiet_bps(now)
        if quiet_bps is None:
            return floor
        # in a busy spell, its rest (as long as the last one) carries no quiet bytes: counted as quiet time, it
        # would leave the bytes it cannot carry to the last busy spell before due_at
        rest = min(time_left, max(0.0, self._busy_s - (now - self._busy_at))) if self._was_busy else 0.0
        beside = left - quiet_bps * (time_left - rest)  # what the tiers' busy time must carry
        return max(floor, beside / (rest + self.busy_share * (time_left - rest)))

    def _quiet_bps(self, now: float) -> Optional[float]:
        """Bytes/s the quiet spells carry, over all time: over the whole cycles seen; before one is, the rate the
        writer has moved at within the quiet time seen, times the tiers' quiet share (``busy_share``, from before
        the writer); None where no quiet time has been seen yet, until ``cycles_by`` (then none is carried)."""
        first, last = self._cycles_first, self._cycles_end
        if first is not None and last[0] > first[0]:
            return (last[1] - first[1]) / (last[0] - first[0])
        quiet_s = self._quiet_s + (now - self._quiet_at if self._was_busy is False else 0.0)
        if quiet_s > 0:
            return self.idle_bytes / quiet_s * (1 - self.busy_share)
        return None if now < self.cycles_by else 0.0

    def spread_bytes(self, now: float) -> float:
        """The most bytes the even spread lets the writer have moved by ``now``, not counting the chunk that
        asks: ``expected_bytes`` evenly over ``1 / AHEAD`` of the time from the start to ``due_at`` (inf without
        a due time or bytes expected, and past it)."""
        if not self.spread or self.due_at is None or self.expected_bytes <= 0 or now >= self.due_at:
            return float("inf")
        return self.expected_bytes * min(1.0, AHEAD * (now - self.started) / (self.due_at - self.started))

    def wait_turn(self, nbytes: int) -> None:
        with self._lock:
            started = self._clock()
            waited = False
            while True:
                now, busy = self._clock(), self.busy()
                moved = self.idle_bytes + self.capped_bytes
                self._follow_cycles(now, busy)
                self._accrue(nbytes)
                if not busy:
                    self.idle_bytes += nbytes
                    break
                elif moved > self.spread_bytes(now):  # beside the steps, ahead of the even spread: it waits
                    self.spread_until = now - self.started
                elif self._credit >= nbytes:
                    self._credit -= nbytes
                    self.capped_bytes += nbytes
                    break
                waited = True
                self._sleep(POLL_S)
            if waited:
                self.waits += 1
                self.waited_s += self._clock() - started

    def _follow_cycles(self, now: float, busy: bool) -> None:
        """At each look: where the tiers go busy, the busy spell's start; where they go quiet after one, its length
        and a cycle's end."""
        if not busy and self._was_busy is not False:  # a quiet spell begins (or the first look finds one)
            self._quiet_at = now
        elif busy and self._was_busy is False:
            self._quiet_s += now - self._quiet_at
        if busy and not self._was_busy:
            self._busy_at = now
        elif not busy and self._was_busy:
            self._busy_s = now - self._busy_at
            self._cycles_end = (now, self.idle_bytes)
            self._cycles_first = self._cycles_first or self._cycles_end
        self._was_busy = busy

    def _accrue(self, nbytes: int) -> None:
        now = self._clock()
        if self._credit_at is not None:
            rate = self.rate_now()
            if rate == float("inf"):
                self.past_due = True
                self._credit = max(self._credit, float(nbytes))
            else:  # banked: one chunk, and what a poll's overshoot accrued beyond it (not lost to the polling)
                if rate > self.cap_bps:
                    self.raised_bps = max(self.raised_bps, rate)
                self._credit = min(self._credit + (now - self._credit_at) * rate,
                                   max(nbytes + rate * POLL_S, self._credit))
        self._credit_at = now

    def report(self) -> str:
        raised = (f" (raised up to {self.raised_bps / 1e9:.2f} GB/s to be done before the next save)"
                  if self.raised_bps else "")
        if self.past_due:
            raised += " (past the time it was due, the rest at once)"
        if self.spread_until is not None:
            raised += (f"; held to an even spread until {self.spread_until:.1f} s of the "
                       f"{self.due_at - self.started:.1f} s to its due time")
        first = (f"began {self.yielded_s:.1f} s later, after the forked writer due first; "
                 if self.yielded_s >= FIRST_POLL_S else "")
        return (f"{human_bytes(self.staged_bytes)} copied aside first in {self.staged_s:.2f} s; {first}"
                f"{human_bytes(self.idle_bytes)} moved in the tiers' idle time, "
                f"{human_bytes(self.capped_bytes)} beside their I/O at <= {self.cap_bps / 1e9:.2f} GB/s{raised}; "
                f"{self.waits} chunks waited {self.waited_s:.1f} s")


def due_at(next_save_in_s: Optional[float], clock: Callable[[], float] = time.monotonic) -> Optional[float]:
    """When a background writer should be done, on ``clock``, for a next save ``next_save_in_s`` from now
    (None: no next save known, no deadline)."""
    return clock() + FINISH_SHARE * next_save_in_s if next_save_in_s is not None else None


def same_device_tiers(engine, path: str) -> List:
    """The engine's file tiers on the device of ``path``'s directory."""
    device = os.stat(os.path.dirname(os.path.abspath(path))).st_dev
    return [tier for tier in engine.file_tiers.values() if tier.device == device]


def pace_save(engine, snapshot, path: str, link_tier_files: bool, digest: bool,
              next_save_in_s: Optional[float] = None) -> Optional[DiskPacer]:
    """The pacer of a background write of ``snapshot`` into ``path``, its staging raised, and the line
    saying how the writer and the tiers share the disk; None where no file tier is on that device.
    ``digest``: the writer reads linked tier files for the resume check's digest; ``next_save_in_s``: when the
    next save comes, which the writer is to be done before (None: unknown)."""
    tiers = same_device_tiers(engine, path)
    if not tiers:
        return None
    ranks = engine.config.resolved_ranks_sharing_node()
    disk_bps = rank_disk_bps([(engine, tier) for tier in tiers])
    busy = recent_busy_share(tiers, next_save_in_s)
    pacer = DiskPacer(tiers, writer_cap(disk_bps), due_at=due_at(next_save_in_s), busy_share=busy)
    memory_bytes = len(snapshot.memory) * snapshot.largest.state_bytes
    if engine.config.save_staging_bytes is None:  # a size given is kept as given
        snapshot.allow_staging(min(memory_bytes, staging_room(ranks) + snapshot.kept_bytes))
    written = sum(state_file_bytes(sg.numel, sg.codecs, sg.blocks) for sg in snapshot.subgroups
                  if sg.index in snapshot.memory or not link_tier_files)
    read = sum(snapshot.subgroups[i].state_bytes for i in snapshot.on_tier) if digest or not link_tier_files else 0
    pacer.expect(written + read)  # each piece written and each tier read waits its turn
    per_s = disk_bps * (1 - busy) + pacer.cap_bps * busy  # the writer's pace if the tiers keep their busy share
    staged = min(snapshot.staging_bytes, memory_bytes)
    # Where the staging holds less than the memory-held state, the updates after the save wait for the writer to
    # reach their subgroups: held to a spread, it would hold them longer.
    pacer.spread = staged >= memory_bytes
    spread = ("" if next_save_in_s is None or not pacer.spread
              else f", spread evenly over its first {FINISH_SHARE * next_save_in_s / AHEAD:.1f} s")
    log.info("async save: writer paced behind the %s tier on %s: %s to write, about %.1f s at the tier's %.0f%% "
             "busy share %s (idle time at the disk's %.2f GB/s, <= %.2f GB/s beside its I/O); the state held "
             "in memory copied aside before the first chunk (%s of %s%s)%s",
             "/".join(t.name for t in tiers), device_name(tiers[0].device), human_bytes(written),
             written / per_s if per_s > 0 else float("inf"), 100 * busy,
             "so far" if next_save_in_s is None else f"over the last {next_save_in_s:.0f} s", disk_bps / 1e9,
             pacer.cap_bps / 1e9, human_bytes(staged), human_bytes(memory_bytes),
             "" if staged >= memory_bytes else "; beyond it the updates wait for the writer",
             "" if next_save_in_s is None else
             f"; to be done within {FINISH_SHARE * next_save_in_s:.1f} s, before the next save (in about "
             f"{next_save_in_s:.1f} s): "
             f"the tiers' quiet spells (the forward and backward) taken as they come; beside their I/O "
             f"{'at the cap' if busy >= NEVER_QUIET or not pacer.spread else 'nothing'} for the first "
             f"{CALIBRATE_SHARE * FINISH_SHARE * next_save_in_s:.1f} s, then what the quiet spells at the rate seen "
             f"leave{spread}")
    whole_disk_s = (written + read) / disk_bps if disk_bps > 0 else 0.0
    if next_save_in_s is not None and whole_disk_s > FINISH_SHARE * next_save_in_s:
        log.warning("async save: its %s to move take %.1f s even at the disk's whole %.2f GB/s, more than the %.1f s "
                    "before the next save: that save will hold training until this one is written (saves further "
                    "apart, or a checkpoint directory on another disk, avoid it)", human_bytes(written + read),
                    whole_disk_s, disk_bps / 1e9, FINISH_SHARE * next_save_in_s)
    return pacer


def recent_busy_share(tiers: Sequence, window_s: Optional[float]) -> float:
    """The busiest of ``tiers``' busy shares over about the last ``window_s`` (as long a stretch as the one to the
    next save; None: since they were made)."""
    return max(tier.activity.busy_share(window_s) for tier in tiers)


def rank_disk_bps(engine_tiers: Sequence[Tuple[object, object]]) -> float:
    """A rank's share of the disk its (engine, file tier) pairs share: the slowest tier's rate over the node's
    ranks (each rank's writers take their part)."""
    ranks = max(engine.config.resolved_ranks_sharing_node() for engine, _ in engine_tiers)
    return min(disk_rate(engine, tier.name) for engine, tier in engine_tiers) / ranks


def writer_cap(disk_bps: float) -> float:
    """Bytes/s one background writer may move beside a busy tier on a disk of ``disk_bps`` (a rank's share)."""
    return max(CAP_SHARE * WRITER_SHARE * disk_bps, MIN_CAP_BPS)


def disk_rate(engine, tier: str) -> float:
    """Bytes/s the tier's device moves: as the last prediction priced it (at the rates the steps showed,
    ``plan.disk_rates``), else the start-up's write rate."""
    prediction = engine.prediction
    seconds = prediction.tier_s.get(tier, 0.0) if prediction is not None else 0.0
    if seconds > 0:
        return (prediction.read_bytes.get(tier, 0) + prediction.write_bytes.get(tier, 0)) / seconds
    rate = engine.rates.get(tier) if engine.rates else None
    return rate.write_bps if rate is not None else 0.0


def reserve_paced_staging(engine, save_dir: str) -> int:
    """Where background saves into ``save_dir`` would be paced (a file tier on its disk) and no staging size is
    configured: the staging ``pace_save`` would allow for the state held in memory, made now and kept from save
    to save; returns its bytes (0: none made)."""
    existing = os.path.abspath(save_dir)
    while not os.path.exists(existing):
        existing = os.path.dirname(existing)
    if engine.config.save_staging_bytes is not None or not same_device_tiers(engine, os.path.join(existing, "x")):
        return 0
    return engine.reserve_save_staging(staging_room(engine.config.resolved_ranks_sharing_node()))


def staging_room(ranks: int) -> int:
    """Host memory a rank's snapshot may stage now: ``HOST_SHARE`` of what the OS has available."""
    available = meminfo_bytes("MemAvailable")
    return int(available * HOST_SHARE / ranks) if available else 0


def device_name(st_dev: int) -> str:
    """``/dev/<name>`` of a device number where sysfs knows it, else ``major:minor``."""
    number = f"{os.major(st_dev)}:{os.minor(st_dev)}"
    link = f"/sys/dev/block/{number}"
    return f"/dev/{os.path.basename(os.path.realpath(link))}" if os.path.exists(link) else f"device {number}"
