"""A writer due before the next save counts on the tiers' quiet spells to come (pacing.DiskPacer's
``quiet_spells``): its raise beside their I/O is spread evenly over their busy spells instead of crowding the
first steps after the save, and it is still done by its due time. The tiers' recent busy share
(``TierActivity.busy_share(window_s)``) against a reference over the same spells. Clocks are simulated."""

import pytest
from hypothesis import given, settings, strategies as st

from mlp_offload.checkpoint import pacing
from mlp_offload.tiers.activity import TierActivity


class Clock:
    def __init__(self):
        self.now = 100.0

    def __call__(self):
        return self.now

    def sleep(self, seconds):
        self.now += seconds


class Spells:
    """A tier's activity that is busy for ``busy_s`` of every ``busy_s + quiet_s`` from its start."""

    def __init__(self, clock, busy_s, quiet_s):
        self.clock, self.busy_s, self.period, self.start = clock, busy_s, busy_s + quiet_s, clock.now

    def quiet(self):
        return (self.clock.now - self.start) % self.period >= self.busy_s

    def spell(self):
        return int((self.clock.now - self.start) // self.period)


class Tier:
    def __init__(self, activity):
        self.activity = activity


def simulate(total, chunk, busy_s, quiet_s, idle_bps, cap, due_in, informed):
    """A writer of ``total`` bytes in ``chunk``s beside a tier of regular spells: a chunk that goes while the
    tier is quiet takes ``chunk / idle_bps`` s, one beside its I/O the time its pacer made it wait. Returns
    (seconds taken, {busy spell: bytes moved beside it}, pacer)."""
    clock = Clock()
    spells = Spells(clock, busy_s, quiet_s)
    quiet_spells = (busy_s / (busy_s + quiet_s), idle_bps) if informed else (1.0, 0.0)
    pacer = pacing.DiskPacer([Tier(spells)], cap, clock=clock, sleep=clock.sleep, due_at=clock.now + due_in,
                             quiet_spells=quiet_spells)
    pacer.expect(total)
    beside, moved, start = {}, 0, clock.now
    while moved < total:
        n = min(chunk, total - moved)
        capped = pacer.capped_bytes
        pacer.wait_turn(n)
        if pacer.capped_bytes > capped:
            beside[spells.spell()] = beside.get(spells.spell(), 0) + n
        else:
            clock.now += n / idle_bps
        moved += n
    return clock.now - start, beside, pacer


def test_the_disk_of_a_save_between_steps_is_spread_over_them_and_done_on_time():
    """A 3 B model's save beside its nvme tier (the steps' shape measured on the GPU machine, rounded): 18 GB
    to move in 18.8 s, the tier busy 4.3 s of every 5.7 s, the disk 2.2 GB/s while it is quiet."""
    shape = dict(total=18e9, chunk=32e6, busy_s=4.3, quiet_s=1.4, idle_bps=2.2e9, cap=0.18e9, due_in=18.8)
    late_s, late, _ = simulate(informed=False, **shape)
    taken_s, even, pacer = simulate(informed=True, **shape)
    assert taken_s <= shape["due_in"] + 0.1  # on time, give or take its last chunk
    full = [even[k] for k in sorted(even)][:-1]  # the last spell is cut short by the end
    assert max(full) <= 1.15 * min(full)
    assert even[0] < 0.7 * late[0]  # counting on none of the quiet spells crowds the first step after the save
    assert late_s < taken_s
    assert "raised up to" in pacer.report()


@settings(max_examples=50, deadline=None)
@given(total_chunks=st.integers(200, 1000), busy_s=st.floats(0.5, 10.0), quiet_s=st.floats(0.2, 5.0),
       spells_due=st.floats(2.0, 8.0), idle_share=st.floats(0.1, 0.9))
def test_a_due_writer_raises_no_more_than_its_busy_spells_need_evenly(total_chunks, busy_s, quiet_s, spells_due,
                                                                        idle_share):
    """Whatever the spells: done by the due time, and no busy spell carries much more than the even rate that
    the quiet spells leave (a quarter more, and two chunks a spell, for where spells and chunks fall), but the
    last, which also carries what the quiet spells brought less than their share said (where the due time
    cuts one short)."""
    chunk = 1e6
    total = total_chunks * chunk
    due_in = spells_due * (busy_s + quiet_s)
    share = busy_s / (busy_s + quiet_s)
    idle_bps = idle_share * total / ((1 - share) * due_in)  # the quiet spells carry idle_share of the bytes
    cap = 0.02 * total / due_in
    taken_s, beside, pacer = simulate(total, chunk, busy_s, quiet_s, idle_bps, cap, due_in, informed=True)
    # the quiet time before the due time is the share's give or take one quiet spell (where the spells fall)
    assert taken_s <= due_in + quiet_s + chunk / idle_bps + pacing.POLL_S * 2
    even_bps = max(cap, (total - idle_bps * (1 - share) * due_in) / (share * due_in))
    spells = int(spells_due) + 1  # each quiet spell may end with a chunk short of what it would carry
    slack = 2 * chunk * spells
    carried = [beside.get(k, 0) for k in range(max(beside, default=0) + 1)]
    assert max(carried[:-1], default=0) <= 1.25 * even_bps * busy_s + slack
    # the last: where the due time falls in a busy spell, the quiet time it was to bring (at most a spell's) too
    assert carried[-1] <= 1.25 * even_bps * busy_s + idle_bps * quiet_s + slack


def test_past_its_due_time_the_report_says_the_rest_went_at_once():
    taken_s, _, pacer = simulate(total=50e6, chunk=1e6, busy_s=1.0, quiet_s=0.0001, idle_bps=1e9, cap=1e3,
                                 due_in=0.5, informed=True)
    assert pacer.past_due and "past the time it was due, the rest at once" in pacer.report()
    assert "1000.00 GB/s" not in pacer.report()


def busy_reference(spells, since, until):
    """Busy seconds of ``spells`` ([start, end) pairs) within [since, until]."""
    return sum(max(0.0, min(end, until) - max(start, since)) for start, end in spells)


@settings(max_examples=80, deadline=None)
@given(gaps=st.lists(st.tuples(st.floats(0.0, 3.0), st.floats(0.01, 3.0)), min_size=1, max_size=30),
       window_s=st.floats(0.1, 40.0), tail=st.floats(0.0, 2.0), open_spell=st.booleans())
def test_the_recent_busy_share_is_the_busy_time_within_the_window(gaps, window_s, tail, open_spell):
    clock = Clock()
    activity = TierActivity(clock=clock)
    made, spells = clock.now, []
    for gap, length in gaps:
        clock.now += gap
        with activity.moving():
            start = clock.now
            clock.now += length
        spells.append((start, clock.now))
    clock.now += tail
    if open_spell:
        moving = activity.moving()
        moving.__enter__()
        spells.append((clock.now, clock.now + 1.0))
        clock.now += 0.5
    now = clock.now
    since = max(made, now - window_s)
    assert activity.busy_share(window_s) == pytest.approx(busy_reference(spells, since, now) / (now - since),
                                                          abs=1e-9)
    assert activity.busy_share() == pytest.approx(busy_reference(spells, made, now) / (now - made), abs=1e-9)


def test_a_busy_share_reaches_back_only_as_far_as_the_spells_remembered(monkeypatch):
    monkeypatch.setattr("mlp_offload.tiers.activity.SPELLS_KEPT", 3)
    clock = Clock()
    activity = TierActivity(clock=clock)
    for _ in range(10):  # busy 1 s of every 2: the first 7 spells forgotten
        with activity.moving():
            clock.now += 1.0
        clock.now += 1.0
    # a window from 108: from the oldest spell remembered (ended at 115) to now (120), the two after it, 2 s of 5
    assert activity.busy_share(12.0) == pytest.approx(2.0 / 5.0)
