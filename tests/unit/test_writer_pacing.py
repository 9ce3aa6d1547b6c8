"""A background checkpoint writer paced behind a file tier on its disk (mlp_offload/checkpoint/pacing.py): each
chunk waits while the tier moves data and goes once it is quiet, or at the cap beside a tier never quiet;
a paced file is the synchronous save's byte for byte and loads to the same steps; the updates after the
save never wait for a paced writer within the staging; a checkpoint on another device is not paced. Clocks
are injected and waits counted: nothing here depends on how fast this machine is."""

import math
import threading
import time

import pytest
import torch
from hypothesis import given, settings, strategies as st

from mlp_offload import faults
from mlp_offload.checkpoint import load_engine_state, pacing
from tests.profiles import examples
from mlp_offload.checkpoint.state_file import human_bytes
from mlp_offload.checkpoint.write import save_engine_state, start_background_save
from mlp_offload.tiers.activity import QUIET_S, TierActivity
from mlp_offload.tiers.direct_io import PIECE, DirectRegionWriter
from mlp_offload.tiers.tokens import TierTokens

from .helpers import engine_state
from .test_background_save import NUMEL, engine_at_step_3, grads, run


class Clock:
    """A clock that moves only when the code under test sleeps."""

    def __init__(self):
        self.now = 100.0
        self.sleeps = 0

    def __call__(self):
        return self.now

    def sleep(self, seconds):
        self.sleeps += 1
        self.now += seconds


class FakeTier:
    def __init__(self, clock):
        self.activity = TierActivity(clock=clock)


def test_a_chunk_waits_while_the_tier_moves_data_and_goes_once_it_is_quiet():
    clock = Clock()
    tier = FakeTier(clock)
    pacer = pacing.DiskPacer([tier], cap_bps=1.0, clock=clock, sleep=clock.sleep)  # the cap never suffices
    pacer.wait_turn(PIECE)  # the tier idle since it was made: at once
    assert (clock.sleeps, pacer.idle_bytes, pacer.waits) == (0, PIECE, 0)
    operation = tier.activity.moving()
    operation.__enter__()
    ends_after = 7

    def sleep(seconds):  # the tier's operation ends during the writer's 7th look
        clock.sleep(seconds)
        if clock.sleeps == ends_after:
            operation.__exit__(None, None, None)

    pacer = pacing.DiskPacer([tier], cap_bps=1.0, clock=clock, sleep=sleep)
    pacer.wait_turn(PIECE)
    assert pacer.waits == 1 and pacer.idle_bytes == PIECE and pacer.capped_bytes == 0
    # it went only once the tier had been quiet for QUIET_S after its operation ended
    assert clock.sleeps >= ends_after + QUIET_S / pacing.POLL_S
    assert pacer.waited_s == pytest.approx(clock.sleeps * pacing.POLL_S)


def test_a_tier_never_quiet_lets_the_writer_through_at_the_cap():
    clock = Clock()
    tier = FakeTier(clock)
    busy = tier.activity.moving()  # held: busy for good
    busy.__enter__()
    chunk, chunks, cap = 10_000, 20, 1e6
    pacer = pacing.DiskPacer([tier], cap_bps=cap, clock=clock, sleep=clock.sleep)
    start = clock.now
    for _ in range(chunks):
        pacer.wait_turn(chunk)
    assert pacer.capped_bytes == chunk * chunks and pacer.idle_bytes == 0  # it finished
    elapsed = clock.now - start
    assert (chunks - 1) * chunk / cap <= elapsed <= chunks * (chunk / cap + pacing.POLL_S)  # no faster than the cap


def test_the_cap_leaves_the_step_its_share_of_the_disk():
    assert 1 / (1 - pacing.CAP_SHARE) == pytest.approx(pacing.SLOWDOWN)


def test_activity_counts_operations_and_their_busy_share():
    clock = Clock()
    activity = TierActivity(clock=clock)
    clock.sleep(1.0)
    with activity.moving():
        with activity.moving():  # overlapping operations count once
            clock.sleep(1.0)
        assert not activity.quiet()
    assert activity.operations == 2 and not activity.quiet()  # just ended
    clock.sleep(1.5 * QUIET_S)
    assert activity.quiet()
    assert activity.busy_share() == pytest.approx(1.0 / (2.0 + 1.5 * QUIET_S))


def test_a_token_held_by_another_process_counts_as_busy(tmp_path):
    ours, theirs = (TierTokens(str(tmp_path), 1, lock_root=str(tmp_path / "locks")) for _ in range(2))
    try:
        assert not ours.held_elsewhere()
        theirs.acquire()  # a separate open file: to flock, another process
        assert ours.held_elsewhere() and not theirs.held_elsewhere()
        theirs.release()
        assert not ours.held_elsewhere()
        ours.acquire()  # our own turn: our activity says busy, the probe leaves our lock alone
        assert not ours.held_elsewhere() and theirs.held_elsewhere()
        ours.release()
    finally:
        ours.close()
        theirs.close()


def test_an_updates_window_is_busy_throughout_its_gaps_and_counts_no_operation():
    clock = Clock()
    activity = TierActivity(clock=clock)
    with activity.window():
        with activity.moving():
            clock.sleep(0.5)
        clock.sleep(10 * QUIET_S)  # a gap of the update's (its compute): not a quiet spell for a writer
        assert not activity.quiet()
    assert activity.operations == 1
    clock.sleep(1.5 * QUIET_S)
    assert activity.quiet()
    assert activity.busy_share() == pytest.approx((0.5 + 10 * QUIET_S) / (0.5 + 11.5 * QUIET_S))


def test_an_updates_window_in_another_process_counts_as_busy_and_several_share_it(tmp_path):
    ours, theirs, third = (TierTokens(str(tmp_path), 1, lock_root=str(tmp_path / "locks")) for _ in range(3))
    try:
        theirs.hold_window()  # separate open files: to flock, other processes
        third.hold_window()  # two ranks' updates at once: the window is shared, neither waits
        assert ours.held_elsewhere() and not theirs.held_elsewhere()  # its own window: its activity says busy
        theirs.release_window()
        assert ours.held_elsewhere()  # the third's still open
        third.release_window()
        assert not ours.held_elsewhere()
        ours.hold_window()
        ours.hold_window()  # nested: held until both end
        ours.release_window()
        assert theirs.held_elsewhere()
        ours.release_window()
        assert not theirs.held_elsewhere()
    finally:
        for tokens in (ours, theirs, third):
            tokens.close()


def test_a_step_keeps_its_file_tiers_busy_between_its_operations(tmp_path, monkeypatch):
    """Seen from a paced writer: each file tier stays busy from the update's start to its end, also where the
    update computes between two of the tier's operations (here one pause of 0.2 s halfway through its subgroups)."""
    with engine_at_step_3(tmp_path / "e") as engine:
        tier = engine.file_tiers["nvme"]
        seen, stepping = [], threading.Event()

        def watch():
            while stepping.is_set():
                seen.append(tier.activity.quiet(quiet_s=0.01))
                time.sleep(0.002)
        monkeypatch.setattr(faults, "_delays", "update=0.2")
        stepping.set()
        watcher = threading.Thread(target=watch)
        watcher.start()
        try:
            engine.step()
        finally:
            stepping.clear()
            watcher.join()
        monkeypatch.setattr(faults, "_delays", None)
        engine.flush()
        time.sleep(0.02)
        assert len(seen) > 60 and not any(seen[1:-1]), (len(seen), sum(seen))  # the watcher's first and last
        # samples may fall just outside the step
        assert tier.activity.quiet(quiet_s=0.01)  # the step over, its writes behind done: quiet again


def test_a_paced_region_writer_writes_the_same_bytes(tmp_path):
    data = torch.randint(0, 256, (2 * PIECE + 12345,), dtype=torch.uint8, generator=torch.Generator().manual_seed(3))
    files = {}
    for name, pace in (("plain", None), ("paced", [])):
        path = str(tmp_path / name)
        with open(path, "wb") as f:
            writer = DirectRegionWriter(f.fileno(), path, pace=pace.append if pace is not None else None)
            crcs = writer.put(777, [data[:1000], data[1000:]])
            writer.finish()
            writer.close()
        files[name] = (open(path, "rb").read(), crcs())
        if pace is not None:
            assert sum(pace) == data.numel() and max(pace) <= PIECE and len(pace) >= 3
    assert files["plain"] == files["paced"]


@pytest.fixture
def quiet_tiers(monkeypatch):
    """The tiers quiet only once the event is set; until then the cap lets nothing through."""
    quiet = threading.Event()
    monkeypatch.setattr(TierActivity, "quiet", lambda self, quiet_s=QUIET_S: quiet.is_set())
    monkeypatch.setattr(pacing, "CAP_SHARE", 0.0)
    monkeypatch.setattr(pacing, "MIN_CAP_BPS", 1e-9)
    return quiet


def test_a_paced_save_never_holds_the_updates_back_and_writes_the_synchronous_bytes(tmp_path, quiet_tiers, caplog):
    later = grads(3, 2)
    with engine_at_step_3(tmp_path / "ref") as reference:
        run(reference, later)
        expected = engine_state(reference)
    with engine_at_step_3(tmp_path / "e") as engine:
        save_engine_state(engine, str(tmp_path / "sync.ckpt"), metadata={"iteration": 3})
        caplog.set_level("INFO", logger="mlp_offload")
        write = start_background_save(engine, str(tmp_path / "paced.ckpt"), metadata={"iteration": 3})
        assert write.pacer is not None and write.snapshot.memory and write.snapshot.on_tier
        assert "async save: writer paced behind the nvme tier on " in caplog.text
        first_turn, wait_turn = threading.Event(), write.pacer.wait_turn
        write.pacer.wait_turn = lambda nbytes: (first_turn.set(), wait_turn(nbytes))[1]
        write.start()
        deadline = time.monotonic() + 60
        while not write.pacer.staged_s and time.monotonic() < deadline:  # the copy aside done (else the update
            time.sleep(0.01)  # would copy a subgroup itself, and the writer would count fewer bytes staged)
        assert first_turn.wait(60)  # the writer at its first chunk (a write helper may take a while to start)
        run(engine, later)  # every subgroup overwritten twice while the writer is held at its first chunk
        assert not write.done() and write.pacer.idle_bytes == 0
        assert write.snapshot.writer_waits == 0  # the updates found their copies made: none waited
        quiet_tiers.set()
        write.wait()
        assert write.failure is None and write.pacer.waits >= 1
        memory_bytes = sum(engine.subgroups[i].state_bytes for i in write.snapshot.memory)
        assert write.pacer.staged_bytes == memory_bytes > 0 and write.pacer.staged_s > 0  # all of it, timed
        assert f"{human_bytes(memory_bytes)} copied aside first in" in write.pacer.report()
        assert all(torch.equal(a, b) for a, b in zip(engine_state(engine), expected))
    assert (tmp_path / "paced.ckpt").read_bytes() == (tmp_path / "sync.ckpt").read_bytes()
    with engine_at_step_3(tmp_path / "r") as resumed:
        assert load_engine_state(resumed, str(tmp_path / "paced.ckpt")) == {"iteration": 3}
        run(resumed, later)
        assert all(torch.equal(a, b) for a, b in zip(engine_state(resumed), expected))


def test_a_save_the_disk_cannot_finish_before_the_next_one_says_so_in_one_line(tmp_path, caplog):
    """Its bytes at the disk's whole rate take longer than the time to the next save: one warning naming both
    figures; with time enough, the pacing line names the due time and nothing warns (a short time: the writer
    spreads its bytes over it)."""
    with engine_at_step_3(tmp_path / "e") as engine:
        caplog.set_level("INFO", logger="mlp_offload")
        for name, next_save_in_s in (("soon", 1e-6), ("later", 1.0)):
            caplog.clear()
            write = start_background_save(engine, str(tmp_path / f"{name}.ckpt"), next_save_in_s=next_save_in_s)
            assert write.pacer is not None and write.pacer.due_at is not None
            assert "before the next save (in about" in caplog.text
            warned = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
            if name == "soon":
                assert len(warned) == 1 and "that save will hold training until this one is written" in warned[0]
            else:
                assert not warned
            write.start()
            write.wait()
            assert write.failure is None


@pytest.mark.parametrize("staging_bytes", [None, 0], ids=["staged", "updates-wait"])
def test_the_spread_holds_only_where_the_updates_do_not_wait_for_the_writer(tmp_path, caplog, staging_bytes):
    """The memory-held state all copied aside: the writer is held to the even spread and its line says so. A
    staging of none (--save-staging-gb 0): the updates after the save wait for the writer to reach their
    subgroups, so no spread holds it back."""
    with engine_at_step_3(tmp_path / "e", save_staging_bytes=staging_bytes) as engine:
        caplog.set_level("INFO", logger="mlp_offload")
        write = start_background_save(engine, str(tmp_path / "x.ckpt"), next_save_in_s=1.0)
        assert write.pacer is not None and write.pacer.spread == (staging_bytes is None)
        assert ("spread evenly over its first" in caplog.text) == (staging_bytes is None)
        assert (write.pacer.spread_bytes(write.pacer.started) == float("inf")) == (staging_bytes == 0)
        write.start()
        write.wait()
        assert write.failure is None


@pytest.mark.parametrize("spread", [False, True])
def test_where_the_updates_wait_for_the_writer_it_keeps_the_cap_beside_a_busy_tier_from_the_start(spread):
    """A staging short of the memory-held state (the spread off): an update waits for the writer to reach its
    subgroups, holding its tier busy meanwhile, so a writer that moved nothing beside a busy tier until the
    calibration's end would hold that update as long. It keeps the cap from the start. With the state copied aside
    (the spread on), the same chunk waits for a quiet spell, or for the calibration's end beside a tier never
    quiet."""
    clock = Clock()
    tier = FakeTier(clock)
    update = tier.activity.moving()
    update.__enter__()
    chunk, cap, due_in = 10_000, 1e6, 100.0
    pacer = pacing.DiskPacer([tier], cap_bps=cap, clock=clock, sleep=clock.sleep, due_at=clock.now + due_in,
                             busy_share=0.7)
    pacer.expect(10 * chunk)
    pacer.spread = spread
    start = clock.now
    pacer.wait_turn(chunk)
    if spread:
        assert clock.now - start >= pacing.CALIBRATE_SHARE * due_in
    else:
        assert clock.now - start <= chunk / cap + 2 * pacing.POLL_S
    assert pacer.capped_bytes == chunk
    update.__exit__(None, None, None)


def test_a_checkpoint_on_another_device_is_not_paced(tmp_path, monkeypatch, caplog):
    with engine_at_step_3(tmp_path / "e") as engine:
        for tier in engine.file_tiers.values():
            monkeypatch.setattr(tier, "device", tier.device + 1)
        caplog.set_level("INFO", logger="mlp_offload")
        write = start_background_save(engine, str(tmp_path / "x.ckpt"))
        assert write.pacer is None and "paced" not in caplog.text
        write.start()
        write.wait()
        assert write.failure is None


def test_a_paced_writer_copies_the_memory_held_state_aside_before_it_links_the_tier_files(tmp_path, quiet_tiers,
                                                                                           monkeypatch):
    """The links' fsyncs may take a while beside other writes; the next update must find its copies made."""
    from mlp_offload.checkpoint import write as write_module
    seen = []

    class RecordingLinks(write_module.PartLinks):
        def link(self, *args, **kwargs):
            seen.append(current.pacer.staged_bytes)
            return super().link(*args, **kwargs)
    monkeypatch.setattr(write_module, "PartLinks", RecordingLinks)
    with engine_at_step_3(tmp_path / "e") as engine:
        current = start_background_save(engine, str(tmp_path / "paced.ckpt"), metadata={"iteration": 3},
                                        link_tier_files=True)
        assert current.pacer is not None and current.snapshot.memory and current.snapshot.on_tier
        quiet_tiers.set()
        current.start()
        current.wait()
        assert current.failure is None
    memory_bytes = sum(engine.subgroups[i].state_bytes for i in current.snapshot.memory)
    assert seen and all(staged == memory_bytes for staged in seen)  # every link came after the whole copy aside


@pytest.mark.parametrize("refuse", [False, True])
def test_a_paced_writer_expects_every_byte_it_moves_even_where_a_link_is_refused(tmp_path, quiet_tiers,
                                                                                 monkeypatch, refuse):
    """The due time paces the bytes expected: a tier file a link refused is read and written instead, and
    those bytes are expected too, or the writer would come late for the next save."""
    from mlp_offload.checkpoint import write as write_module
    if refuse:
        monkeypatch.setattr(write_module.PartLinks, "link", lambda self, *args, **kwargs: None)
    with engine_at_step_3(tmp_path / "e") as engine:
        write = start_background_save(engine, str(tmp_path / "paced.ckpt"), link_tier_files=True,
                                      next_save_in_s=1.0)  # the writer spreads its bytes over the time to it
        assert write.pacer is not None and write.snapshot.on_tier
        planned = write.pacer.expected_bytes
        quiet_tiers.set()
        write.start()
        write.wait()
        assert write.failure is None
        moved = write.pacer.idle_bytes + write.pacer.capped_bytes
        assert write.pacer.expected_bytes == moved
        assert (moved > planned) == refuse  # the refused links' bytes came on top of the plan


def busy_pacer(cap, due_in, expected):
    """A pacer beside a tier that never goes quiet, due ``due_in`` s from now (None: no due time)."""
    clock = Clock()
    tier = FakeTier(clock)
    tier.busy = tier.activity.moving()  # held (kept referenced): busy for good
    tier.busy.__enter__()
    due = clock.now + due_in if due_in is not None else None
    pacer = pacing.DiskPacer([tier], cap_bps=cap, clock=clock, sleep=clock.sleep, due_at=due)
    pacer.expect(expected)
    return clock, pacer


@settings(max_examples=60, deadline=None)
@given(chunks=st.lists(st.integers(1_000, 64_000), min_size=1, max_size=30),
       cap=st.floats(1e3, 1e6), due_in=st.floats(0.5, 60.0))
def test_a_writer_due_before_the_next_save_is_done_by_then_and_no_faster_than_it_needs(chunks, cap, due_in):
    """Beside a tier never quiet the cap alone would take total / cap, and the even spread holds a faster one to
    about ``1 / AHEAD`` of the time to the due time; the cap rises to what finishes by then, and only where the
    cap is short of it (never faster than the slower of the two needs, give or take a chunk)."""
    total = sum(chunks)
    clock, pacer = busy_pacer(cap, due_in, total)
    start = clock.now
    for chunk in chunks:
        pacer.wait_turn(chunk)
    elapsed = clock.now - start
    assert pacer.capped_bytes == total and pacer.idle_bytes == 0
    on_time = min(due_in, max(total / cap, due_in / pacing.AHEAD))  # the cap or the spread, else the due time
    assert elapsed <= on_time + len(chunks) * pacing.POLL_S + 1e-9
    spread_bps = pacing.AHEAD * total / due_in
    assert elapsed >= on_time - max(chunks) / min(cap, spread_bps) - 1e-9  # one chunk banked, or ahead, at most
    if total / cap + len(chunks) * pacing.POLL_S < due_in * 0.999:  # each chunk's wait may overshoot one poll
        assert not pacer.raised_bps  # the cap was enough
    elif total / cap > due_in * 1.001:
        assert pacer.raised_bps > cap
    if pacer.raised_bps:
        assert "to be done before the next save" in pacer.report()


def test_without_a_due_time_the_cap_holds_and_past_it_the_rest_goes_at_once_and_the_report_says_so():
    chunks, chunk, cap = 10, 10_000, 1e4  # the cap alone: 10 s
    clock, pacer = busy_pacer(cap, None, chunks * chunk)
    start = clock.now
    for _ in range(chunks):
        pacer.wait_turn(chunk)
    assert clock.now - start >= (chunks - 1) * chunk / cap and not pacer.raised_bps
    clock, pacer = busy_pacer(cap, 1.0, chunks * chunk)
    clock.now += 5.0  # past due before the first chunk
    start = clock.now
    for _ in range(chunks):
        pacer.wait_turn(chunk)
    assert clock.now - start <= chunks * pacing.POLL_S + 1e-9
    assert pacer.past_due and "past the time it was due, the rest at once" in pacer.report()
    assert "GB/s to be done" not in pacer.report()  # no finite raise before it (an infinite rate is no figure)


def test_the_polls_overshoot_is_banked_so_the_cap_is_the_rate_the_chunks_get():
    """A chunk that accrues in 1.6 polls waits 2; what the second poll accrued beyond it goes to the next chunk,
    so 100 chunks take the cap's 0.8 s (give or take a poll and a chunk), not two polls each (1.0 s)."""
    chunk = 1_000
    cap = chunk / (1.6 * pacing.POLL_S)
    clock, pacer = busy_pacer(cap, None, 100 * chunk)
    start = clock.now
    for _ in range(100):
        pacer.wait_turn(chunk)
    assert clock.now - start == pytest.approx(100 * chunk / cap, abs=pacing.POLL_S + chunk / cap)


def test_a_busy_share_over_a_recent_window_sees_the_steps_lately_not_since_the_start():
    clock = Clock()
    activity = TierActivity(clock=clock)
    for busy, quiet in ((0.9, 0.1),) * 10 + ((0.1, 0.9),) * 10:  # 10 s busy 90% of the time, then 10 s at 10%
        with activity.moving():
            clock.sleep(busy)
        clock.sleep(quiet)
    assert activity.busy_share() == pytest.approx(0.5, abs=0.01)
    assert activity.busy_share(5.0) == pytest.approx(0.1, abs=0.02)
    assert activity.busy_share(15.0) == pytest.approx((5 * 0.9 + 10 * 0.1) / 15, abs=0.05)
    assert activity.busy_share(1e6) == pytest.approx(0.5, abs=0.01)  # longer than it lived: since it was made


class StepsTier:
    """A tier whose I/O comes in steps of ``step_s``: quiet for the first ``1 - busy`` of each (the forward and
    backward), then busy (the update); its state follows the clock each time the clock moves."""

    def __init__(self, clock, step_s, busy):
        self.clock, self.step_s, self.busy = clock, step_s, busy
        self.activity = TierActivity(clock=clock)
        self._op = None

    def follow(self):
        in_update = (self.clock.now % self.step_s) >= (1 - self.busy) * self.step_s
        if in_update and self._op is None:
            self._op = self.activity.moving()
            self._op.__enter__()
        elif not in_update and self._op is not None:
            self._op.__exit__(None, None, None)
            self._op = None


def paced_write_beside_steps(total, chunk, disk_bps, busy, steps_to_due, step_s=1.0, phase=0.0):
    """A writer of ``total`` bytes in ``chunk``s (each taking the disk's time to write), beside a tier in steps,
    due ``steps_to_due`` steps from when it starts, ``phase`` of a step into one (0: at a step's start, as a save
    comes; later where it waited for a writer due first): (seconds it took, bytes it moved beside the tier's I/O
    per step, bytes it moved per step, the pacer), the steps counted from its start."""
    clock = Clock()
    clock.now = phase * step_s
    tier = StepsTier(clock, step_s, busy)
    tier.follow()

    def advance(seconds):
        clock.sleep(seconds)
        tier.follow()

    cap = pacing.writer_cap(disk_bps)
    start = clock.now
    pacer = pacing.DiskPacer([tier], cap_bps=cap, clock=clock, sleep=advance, due_at=start + steps_to_due * step_s,
                             busy_share=busy)
    pacer.expect(total)
    beside, moved = [0] * (4 * steps_to_due + 2), [0] * (4 * steps_to_due + 2)
    for _ in range(total // chunk):
        capped = pacer.capped_bytes
        pacer.wait_turn(chunk)
        beside[int((clock.now - start) // step_s)] += pacer.capped_bytes - capped
        moved[int((clock.now - start) // step_s)] += chunk
        advance(chunk / disk_bps)
    return clock.now - start, beside, moved, pacer


@settings(max_examples=examples(120), deadline=None)
@given(busy=st.floats(0.5, 0.9), steps_to_due=st.integers(4, 10), load=st.floats(0.2, 2.0),
       phase=st.floats(0.0, 0.999))
def test_the_steps_right_after_a_save_pay_no_raise_and_the_writer_is_done_by_its_due_time(busy, steps_to_due, load,
                                                                                         phase):
    """Beside a tier quiet for part of each step, with ``load`` times the bytes its quiet spells and the cap could
    carry by the due time: the first step after the save moves no more beside the tier's I/O than the cap; the
    writer, starting anywhere in a step, is done by the due time (give or take two chunks' polls); where the quiet
    spells alone could carry the whole of it with room to spare, the cap is never raised; a raise goes to the steps after the calibration,
    none of them taking half as much again as their mean. The rule before (a rate raised from the start to
    what the bytes left need by the due time, blind to the quiet spells) moved its largest share beside the
    first step."""
    disk_bps, chunk = 1e9, 10_000_000  # a chunk: 10 ms of the disk
    cap = pacing.writer_cap(disk_bps)
    quiet_capacity = (1 - busy) * steps_to_due * disk_bps
    capacity = quiet_capacity + busy * steps_to_due * cap
    total = int(min(load * capacity, 0.8 * steps_to_due * disk_bps)) // chunk * chunk
    if total < chunk:
        return
    elapsed, beside, _, pacer = paced_write_beside_steps(total, chunk, disk_bps, busy, steps_to_due, phase=phase)
    assert beside[0] <= cap * (busy + pacing.POLL_S) + chunk + 1  # the first step: the cap alone (a chunk banked)
    assert elapsed <= steps_to_due + 2 * (chunk / disk_bps + pacing.POLL_S)
    if total <= 0.5 * quiet_capacity:
        assert not pacer.raised_bps
    if pacer.raised_bps:  # the raise went to the steps after the calibration, about evenly
        after = beside[math.ceil(pacing.CALIBRATE_SHARE * steps_to_due):steps_to_due]
        assert max(after) >= beside[0]
        assert max(after) <= 1.5 * sum(after) / len(after) + 2 * chunk


@settings(max_examples=examples(120), deadline=None)
@given(busy=st.floats(0.5, 0.9), steps_to_due=st.integers(4, 10), share=st.floats(0.1, 0.5),
       phase=st.floats(0.0, 0.999))
def test_with_quiet_spells_to_spare_the_writer_moves_nothing_beside_the_tiers_io(busy, steps_to_due, share, phase):
    """Beside a tier quiet for part of each step (the forward and backward), with ``share`` of what its quiet spells
    alone could carry by the due time, the writer starting anywhere in a step: every byte goes in a quiet spell,
    none beside the tier's I/O, taken as they come (done within the steps its quiet spells need, and a step more)
    and by the due time. The rule before spread the bytes evenly over every stretch, and moved most of them beside
    the updates; the one before this one measured the quiet spells from the writer's start, so a writer that began
    in a busy spell or late in a quiet one saw them carry less than they do, and raised its rate beside the updates."""
    disk_bps, chunk = 1e9, 1_000_000  # a chunk: 1 ms of the disk
    total = int(share * (1 - busy) * steps_to_due * disk_bps) // chunk * chunk
    elapsed, beside, _, pacer = paced_write_beside_steps(total, chunk, disk_bps, busy, steps_to_due, phase=phase)
    assert pacer.idle_bytes == total and pacer.capped_bytes == 0 and not any(beside)
    usable = (1 - busy) - QUIET_S - pacing.POLL_S  # of a step's quiet spell: the tier is quiet QUIET_S after its I/O
    assert elapsed <= math.ceil(total / (usable * disk_bps)) + 1
    assert elapsed <= steps_to_due + 2 * (chunk / disk_bps + pacing.POLL_S)


@settings(max_examples=40, deadline=None)
@given(runs_s=st.floats(0.0, 30.0), first_due_in=st.one_of(st.none(), st.floats(1.0, 40.0)),
       due_in=st.one_of(st.none(), st.floats(2.0, 60.0)), spread=st.booleans())
def test_a_writer_waits_for_the_one_due_first_then_paces_anew(runs_s, first_due_in, due_in, spread):
    """While the writer due first runs, none of this one's chunks go: it waits until that one ends, or until that
    one's due time or half the time to its own, whichever comes first; its pacing (the calibration included) then
    starts from there. Where the updates wait for it (spread off) it never waits."""
    clock = Clock()
    tier = FakeTier(clock)  # quiet throughout
    start = clock.now
    due = start + due_in if due_in is not None else None
    pacer = pacing.DiskPacer([tier], cap_bps=1e6, clock=clock, sleep=clock.sleep, due_at=due)
    pacer.spread = spread
    pacer.first = lambda: clock.now < start + runs_s
    pacer.first_until = start + first_due_in if first_due_in is not None else None
    checks = []
    pacer.yield_to_first(lambda: checks.append(clock.now))
    ends = [start + runs_s] + [start + t for t in (first_due_in, None if due_in is None else
                                                   pacing.FIRST_SHARE * due_in) if t is not None]
    limits = [end - start for end in ends]  # as the clock's floats have them
    waited = clock.now - start
    if not spread:
        assert waited == 0 and pacer.started == start
        return
    assert min(limits) - 1e-9 <= waited < min(limits) + pacing.FIRST_POLL_S + 1e-9
    assert len(checks) == clock.sleeps  # a cancel is seen at every look
    if waited > 0:
        assert pacer.started == clock.now
        if due is not None:
            assert pacer.calibrated_at == pytest.approx(clock.now + pacing.CALIBRATE_SHARE * (due - clock.now))
    pacer.expect(10)
    pacer.wait_turn(10)  # the tier is quiet: the chunk goes at once
    assert pacer.idle_bytes == 10
    assert ("after the forked writer due first" in pacer.report()) == (waited >= pacing.FIRST_POLL_S)


def test_a_cancel_while_waiting_for_the_writer_due_first_ends_the_wait():
    clock = Clock()
    pacer = pacing.DiskPacer([FakeTier(clock)], cap_bps=1e6, clock=clock, sleep=clock.sleep)
    pacer.first = lambda: True  # never ends, no due time: only the cancel stops it

    def cancel_after_a_second():
        if clock.now >= 101.0:
            raise RuntimeError("cancelled")

    with pytest.raises(RuntimeError, match="cancelled"):
        pacer.yield_to_first(cancel_after_a_second)
