"""megatron-core's forked torch_dist writer flushes its files paced behind the file tiers
(mlp_offload/checkpoint/paced_flush.py, installed by megatron/training/checkpoint/async_save.forked_writer; the
files it opens, mlp_offload/checkpoint/paced_file.py):
each byte range of a file written back once, in order, each piece after its turn, then one real fsync;
pieces wait while another process holds a tier's token; without sync_file_range or a tier on the disk,
plain fsyncs; the rank's own ``os.fsync`` is never replaced. Clocks are injected, waits counted."""

import contextlib
import multiprocessing
import os
import sys
import time

import pytest
import torch
from hypothesis import given, settings, strategies as st
from unittest import mock

from megatron.training.checkpoint.async_save import bucket_bytes, forked_writer
from megatron.training.runtime import io_priority
from mlp_offload.checkpoint import paced_file, paced_flush
from mlp_offload.config.align import ALIGN, align_down
from mlp_offload.checkpoint.pacing import POLL_S, DiskPacer, disk_rate, writer_cap
from mlp_offload.tiers.activity import QUIET_S
from mlp_offload.tiers.tokens import TierTokens

from tests.profiles import examples

from .test_background_save import engine_at_step_3
from .test_writer_pacing import Clock

PIECE = 1000


def file_of(path, nbytes):
    with open(path, "wb") as f:
        f.write(os.urandom(nbytes))
    return os.open(path, os.O_RDWR)


class Recorder:
    """The syscalls and the pacer of a paced flush, each call noted in one list (their order)."""

    def __init__(self, clock=None):
        self.calls = []
        self.clock = clock

    def sync_range(self, fd, offset, nbytes):
        self.calls.append(("range", offset, nbytes) if self.clock is None else ("range", offset, self.clock.now))

    def fsync(self, fd):
        self.calls.append(("fsync",))

    def wait_turn(self, nbytes):
        self.calls.append(("turn", nbytes))

    def expect(self, nbytes):
        self.calls.append(("expect", nbytes))


def test_every_range_is_written_back_once_in_order_each_after_its_turn_then_fsynced(tmp_path):
    fd = file_of(tmp_path / "f", 2 * PIECE + 345)
    rec, counts = Recorder(), paced_file.FlushCounts()
    try:
        paced_flush.paced_flush(fd, rec, rec.sync_range, rec.fsync, counts, piece=PIECE)
    finally:
        os.close(fd)
    assert rec.calls == [("expect", 2 * PIECE + 345),  # the whole file announced for the pacer's due time
                         ("turn", PIECE), ("range", 0, PIECE), ("turn", PIECE), ("range", PIECE, PIECE),
                         ("turn", 345), ("range", 2 * PIECE, 345), ("fsync",)]
    assert (counts.files, counts.pieces, counts.nbytes, counts.unpaced) == (1, 3, 2 * PIECE + 345, 0)


def test_the_real_sync_file_range_writes_a_file_back_and_a_refusal_falls_back_to_the_fsync(tmp_path):
    sync_range = paced_flush.sync_file_range()
    if sync_range is None:
        pytest.skip("no sync_file_range here (Linux only)")
    fd = file_of(tmp_path / "f", 3 * PIECE)
    rec, counts = Recorder(), paced_file.FlushCounts()
    try:
        paced_flush.paced_flush(fd, rec, sync_range, rec.fsync, counts, piece=PIECE)
    finally:
        os.close(fd)
    assert counts.pieces == 3 and counts.unpaced == 0 and rec.calls[-1] == ("fsync",)
    read_end, write_end = os.pipe()  # a pipe: the kernel refuses sync_file_range (ESPIPE)
    try:
        with pytest.raises(OSError):
            sync_range(write_end, 0, PIECE)
    finally:
        os.close(read_end)
        os.close(write_end)
    refused, counts = Recorder(), paced_file.FlushCounts()

    def refuse(fd, offset, nbytes):
        raise OSError(22, "Invalid argument")

    fd = file_of(tmp_path / "g", 3 * PIECE)
    try:
        paced_flush.paced_flush(fd, refused, refuse, refused.fsync, counts, piece=PIECE)
    finally:
        os.close(fd)
    assert counts.unpaced == 1 and refused.calls[-1] == ("fsync",)  # durable all the same


def test_pieces_wait_while_another_process_holds_a_tier_token(tmp_path):
    clock = Clock()
    locks = str(tmp_path / "locks")
    ours, theirs = TierTokens(str(tmp_path), 1, lock_root=locks), TierTokens(str(tmp_path), 1, lock_root=locks)
    rec = Recorder(clock)
    events = {7: theirs.release, 30: theirs.release}  # at these looks, the other process's operation ends

    def sleep(seconds):
        clock.sleep(seconds)
        if clock.sleeps in events:
            events[clock.sleeps]()

    def sync_range(fd, offset, nbytes):
        rec.sync_range(fd, offset, nbytes)
        if offset == PIECE:  # while the second piece goes, the other process starts an operation
            theirs.acquire()

    tier = paced_flush.SeenTier(ours, clock)
    pacer = DiskPacer([tier], cap_bps=1.0, clock=clock, sleep=sleep)  # the cap never lets a piece through
    fd = file_of(tmp_path / "f", 3 * PIECE)
    try:
        theirs.acquire()
        start = clock.now
        paced_flush.paced_flush(fd, pacer, sync_range, rec.fsync, paced_file.FlushCounts(), piece=PIECE)
    finally:
        os.close(fd)
        ours.close()
        theirs.close()
    (_, o1, t1), (_, o2, t2), (_, o3, t3), last = rec.calls
    assert (o1, o2, o3, last) == (0, PIECE, 2 * PIECE, ("fsync",))
    assert t1 >= start + 7 * POLL_S  # held until the 7th look
    assert t2 == t1  # the tier quiet: at once
    assert t3 >= t2 + (30 - 7) * POLL_S - 1e-9  # held again until the 30th look
    assert pacer.waits == 2 and pacer.idle_bytes == 3 * PIECE and pacer.capped_bytes == 0


def test_a_token_seen_held_keeps_the_tier_busy_for_the_quiet_time(tmp_path):
    clock = Clock()
    locks = str(tmp_path / "locks")
    ours, theirs = TierTokens(str(tmp_path), 1, lock_root=locks), TierTokens(str(tmp_path), 1, lock_root=locks)
    try:
        activity = paced_flush.SeenTier(ours, clock).activity
        assert activity.quiet()
        theirs.acquire()
        assert not activity.quiet()
        theirs.release()
        assert not activity.quiet()  # between two operations of a step
        clock.sleep(0.5 * QUIET_S)
        assert not activity.quiet()
        clock.sleep(QUIET_S)
        assert activity.quiet()
    finally:
        ours.close()
        theirs.close()


def test_the_pacing_sees_the_tiers_on_the_checkpoints_disk_only(tmp_path, monkeypatch):
    with engine_at_step_3(tmp_path / "e") as engine:
        (tmp_path / "ckpt").mkdir()
        pacing = paced_flush.flush_pacing([engine], str(tmp_path / "ckpt" / "iter_0000002"), 4)
        assert pacing is not None and pacing.tier_names == ("nvme",)
        tier = engine.file_tiers["nvme"]
        assert pacing.tier_tokens == ((tier.root, tier.tokens.lock_files),)
        assert pacing.running_path == os.path.join(tier.tokens.lock_dir, paced_flush.RUNNING)  # node-wide
        assert pacing.cap_bps == pytest.approx(writer_cap(disk_rate(engine, "nvme")) / 4)
        assert "paced behind the nvme tier" in pacing.describe()
        monkeypatch.setattr(tier, "device", -1)  # the tier on another disk
        assert paced_flush.flush_pacing([engine], str(tmp_path / "ckpt" / "iter_0000002"), 4) is None
        monkeypatch.undo()
        monkeypatch.setattr(paced_flush, "sync_file_range", lambda: None)  # no sync_file_range: plain fsyncs
        assert paced_flush.flush_pacing([engine], str(tmp_path / "ckpt" / "iter_0000002"), 4) is None


@pytest.mark.parametrize("next_save_in_s, expire, due_in, why", [
    (100.0, "3000\n", 24.0, "before the kernel's flusher takes pages dirty for 30 s"),  # the age first
    (10.0, "3000\n", 9.0, "before the next save"),  # FINISH_SHARE of the time to the next save first
    (None, "3000\n", 24.0, "before the kernel's flusher takes pages dirty for 30 s"),  # no next save known
    (100.0, "0\n", 90.0, "before the next save"),  # the age off
    (100.0, None, 90.0, "before the next save")])  # no such file
def test_the_flushes_are_due_before_the_kernel_takes_their_dirty_pages(tmp_path, monkeypatch, next_save_in_s,
                                                                           expire, due_in, why):
    """The kernel's flusher threads write back pages dirty longer than its age limit themselves, at once: the
    flushes are due by EXPIRE_SHARE of it where that comes before the next save."""
    path = tmp_path / "dirty_expire_centisecs"
    if expire is not None:
        path.write_text(expire)
    monkeypatch.setattr(paced_flush, "DIRTY_EXPIRE", str(path))
    with engine_at_step_3(tmp_path / "e") as engine:
        (tmp_path / "ckpt").mkdir()
        before = time.monotonic()
        flush = paced_flush.flush_pacing([engine], str(tmp_path / "ckpt" / "iter_0000002"), 4, next_save_in_s)
        after = time.monotonic()
    assert before + due_in - 1e-6 <= flush.due_at <= after + due_in + 1e-6
    assert flush.due_why == why and why in flush.describe()


def test_no_sync_file_range_off_linux_and_nothing_installed_without_it(tmp_path, monkeypatch):
    monkeypatch.setattr(sys, "platform", "darwin")
    assert paced_flush.sync_file_range() is None
    original = os.fsync
    assert not paced_flush.install(_pacing(tmp_path))
    assert os.fsync is original


def _pacing(tmp_path, report=None):
    (tmp_path / "tier").mkdir(exist_ok=True)
    return paced_flush.FlushPacing(("nvme",), ((str(tmp_path / "tier"), 1),), str(tmp_path / "locks"), 1e12, report)


def _write_and_fsync(path, queue):
    """What megatron-core's worker does at the end of a file; says which fsync it found."""
    with open(path, "wb") as f:
        f.write(os.urandom(3 * paced_file.PIECE // 2))
        f.flush()
        os.fsync(f.fileno())
    queue.put(os.fsync.__name__)


def _in_a_forked_writer(write, pacing, path):
    """``write(path, queue)`` run as megatron-core's forked writer runs it, with ``pacing``: what it queued."""
    context = multiprocessing.get_context("fork")
    queue = context.Queue()
    child = context.Process(target=forked_writer(write, pacing), args=(path, queue))
    child.start()
    child.join()
    assert child.exitcode == 0
    return queue.get(timeout=10)


@pytest.mark.skipif(paced_flush.sync_file_range() is None, reason="no sync_file_range here (Linux only)")
def test_a_forked_writer_flushes_paced_and_the_ranks_fsync_stays_as_it_was(tmp_path):
    original = os.fsync
    report = str(tmp_path / "report")
    queue = multiprocessing.get_context("fork").Queue()
    assert _in_a_forked_writer(_write_and_fsync, _pacing(tmp_path, report), str(tmp_path / "f")) == "paced_fsync"
    assert os.fsync is original  # the rank's own
    assert paced_file.read_report(report).startswith("1 files flushed paced (0.050 GB in 2 pieces")
    assert not os.path.exists(report)
    # run in the process that made it (megatron-core's writer called in the rank itself): nothing changed
    io_class = io_priority.io_priority_class()
    forked_writer(_write_and_fsync, _pacing(tmp_path, report))(str(tmp_path / "g"), queue)
    assert queue.get(timeout=10) == "fsync" and os.fsync is original
    assert io_priority.io_priority_class() == io_class


def test_without_pacing_the_forked_writer_keeps_the_plain_fsync(tmp_path):
    assert _in_a_forked_writer(_write_and_fsync, None, str(tmp_path / "f")) == "fsync"


def test_installed_in_a_process_only_regular_files_are_paced(tmp_path):
    original = os.fsync
    report = str(tmp_path / "report")
    assert paced_flush.install(_pacing(tmp_path, report))
    try:
        assert os.fsync is not original and not paced_flush.install(_pacing(tmp_path))  # once per process
        read_end, write_end = os.pipe()
        with pytest.raises(OSError):  # a pipe: the real fsync's own answer (EINVAL), no pacing
            os.fsync(write_end)
        os.close(read_end)
        os.close(write_end)
        assert not os.path.exists(report) and not (tmp_path / "locks").exists()  # no pacer made, no token opened
        fd = file_of(tmp_path / "f", 10)
        os.fsync(fd)  # a regular file: paced
        os.close(fd)
        assert paced_file.read_report(report).startswith("1 files flushed paced")
    finally:
        paced_flush.uninstall()
    assert os.fsync is original


def test_the_offload_writer_and_torch_dists_flushes_together_leave_the_step_its_share(tmp_path):
    """Beside a busy tier, both background writers of an --async-save at their caps take at most CAP_SHARE of the
    disk together, so the step's I/O keeps 1 / SLOWDOWN of it."""
    from mlp_offload.checkpoint import pacing as disk_pacing
    from mlp_offload.checkpoint.write import start_background_save
    with engine_at_step_3(tmp_path / "e") as engine:
        (tmp_path / "ckpt").mkdir()
        processes = 3
        flush = paced_flush.flush_pacing([engine], str(tmp_path / "ckpt" / "iter_0000002"), processes)
        write = start_background_save(engine, str(tmp_path / "ckpt" / "state"), metadata={"iteration": 3})
        try:
            assert flush is not None and write.pacer is not None
            rate = disk_rate(engine, "nvme")
            assert rate * disk_pacing.CAP_SHARE > disk_pacing.MIN_CAP_BPS * 2  # the floor plays no part here
            together = write.pacer.cap_bps + flush.cap_bps * processes
            assert together <= disk_pacing.CAP_SHARE * rate * (1 + 1e-9)
            assert 1 / (1 - together / rate) <= disk_pacing.SLOWDOWN + 1e-9
        finally:
            write.cancel()


def _hold_then_exit(seconds):
    time.sleep(seconds)


def test_a_lock_taken_across_a_fork_lives_as_long_as_the_forked_process(tmp_path):
    """The rank's shared lock, taken before the fork and its copy closed after, is held by the forked writer alone:
    seen while it runs, gone once it exits; without a path nothing is held."""
    pacing = paced_flush.FlushPacing(("nvme",), (), None, 1e8, running_path=str(tmp_path / paced_flush.RUNNING))
    assert not pacing.writer_running()
    with pacing.held_across_fork():
        child = multiprocessing.get_context("fork").Process(target=_hold_then_exit, args=(1.0,))
        child.start()
    assert pacing.writer_running()  # the rank closed its copy: the child's keeps it
    child.join()
    assert child.exitcode == 0
    assert not pacing.writer_running()
    with pacing.held_across_fork():
        assert pacing.writer_running()  # held by this process: another copy of the file is refused
    assert not pacing.writer_running()
    unnamed = paced_flush.FlushPacing(("nvme",), (), None, 1e8)
    with unnamed.held_across_fork():
        assert not unnamed.writer_running()


# PacedFile: a forked writer's file on the disk as it is written (megatron-core's ``open(path, "wb")`` replaced).

class Turns:
    """A pacer that notes each turn and each announcement."""

    def __init__(self):
        self.turns, self.expected = [], 0

    def wait_turn(self, nbytes):
        self.turns.append(nbytes)

    def expect(self, nbytes):
        self.expected += nbytes


def _paced(tmp_path, sync_range, pacer):
    return paced_file.ProcessPacing(lambda: pacer, sync_range, str(tmp_path / "report"))


@settings(max_examples=examples(60), deadline=None)
@given(chunks=st.lists(st.integers(0, 5 * ALIGN), max_size=12), pieces=st.integers(1, 3),
       expected_share=st.sampled_from([0.0, 0.5, 1.0]), direct=st.booleans())
def test_a_paced_file_holds_what_was_written_each_piece_after_its_turn(tmp_path_factory, chunks, pieces,
                                                                      expected_share, direct):
    """Any chunks written give the same file as a plain write; each piece of the file waits its turn once, in
    order, and the pacer is told every byte (up front where the size is known, the rest as it comes); what does not
    go by O_DIRECT is written back by the range."""
    tmp_path = tmp_path_factory.mktemp("paced_file")
    data = os.urandom(sum(chunks))
    pacer, ranges = Turns(), []
    paced = _paced(tmp_path, lambda fd, offset, nbytes: ranges.append((offset, nbytes)), pacer)
    expected = int(expected_share * len(data))
    no_direct = mock.patch.object(paced_file, "open_direct", lambda path, flags: None)
    with contextlib.nullcontext() if direct else no_direct:
        f = paced_file.PacedFile(str(tmp_path / "f"), paced, expected, piece=pieces * ALIGN)
    with f:
        at = 0
        for n in chunks:
            assert f.write(memoryview(data)[at: at + n]) == n and f.tell() == at + n
            at += n
        f.flush()
        os.fsync(f.fileno())  # the real one: nothing installed here
    assert (tmp_path / "f").read_bytes() == data
    piece = pieces * ALIGN
    assert pacer.turns == [min(piece, len(data) - lo) for lo in range(0, len(data), piece)]
    assert pacer.expected == len(data) or (not data and pacer.expected == 0)
    assert paced.counts.files == 1 and paced.counts.pieces == len(pacer.turns) and paced.counts.nbytes == len(data)
    if f.direct is None and not direct:  # through the page cache: every byte written back at once
        assert ranges == [(lo, min(piece, len(data) - lo)) for lo in range(0, len(data), piece)]
    elif direct and paced_file.open_direct(str(tmp_path / "f"), os.O_WRONLY) is not None:
        assert ranges == ([(align_down(len(data)), len(data) % ALIGN)] if len(data) % ALIGN else [])


def test_a_paced_file_whose_range_write_back_is_refused_leaves_it_to_the_fsync(tmp_path):
    pacer = Turns()

    def refuse(fd, offset, nbytes):
        raise OSError(22, "Invalid argument")

    paced = _paced(tmp_path, refuse, pacer)
    with mock.patch.object(paced_file, "open_direct", lambda path, flags: None):
        with paced_file.PacedFile(str(tmp_path / "f"), paced, 0, piece=ALIGN) as f:
            f.write(b"x" * (3 * ALIGN))
    assert (tmp_path / "f").read_bytes() == b"x" * (3 * ALIGN)
    assert paced.counts.unpaced == 1 and paced.sync_range is None and pacer.turns == [ALIGN] * 3


@pytest.mark.skipif(paced_flush.sync_file_range() is None, reason="no sync_file_range here (Linux only)")
def test_the_fsync_of_a_paced_file_writes_its_end_first_and_reports_it(tmp_path):
    """megatron-core fsyncs its file before closing it: the installed fsync writes the file's unfilled piece, then
    the real fsync; the report counts the file."""
    report = str(tmp_path / "report")
    paced_open = paced_flush.install(_pacing(tmp_path, report))
    try:
        assert paced_open is not None
        data = os.urandom(paced_file.PIECE + 3 * ALIGN + 5)
        with paced_open(str(tmp_path / "f"), len(data)) as f:
            f.write(data)
            assert os.path.getsize(tmp_path / "f") == paced_file.PIECE  # one piece on the disk, the end not yet
            os.fsync(f.fileno())
            assert os.path.getsize(tmp_path / "f") == len(data)
        assert (tmp_path / "f").read_bytes() == data and not paced_file.PacedFile.OPEN
        expected = f"1 files flushed paced ({len(data) / 1e9:.3f} GB in 2 pieces"
        assert paced_file.read_report(report).startswith(expected)
    finally:
        paced_flush.uninstall()


def test_the_write_buckets_sizes_are_what_each_file_will_hold():
    import io
    tensor = torch.arange(10, dtype=torch.float32)
    buckets = [("/ckpt/__0_0.distcp", "__0_0.distcp", ([(None, io.BytesIO(b"abc"))], [(None, tensor)])),
               ("/ckpt/__0_1.distcp", "__0_1.distcp", ([], [(None, tensor[2:4].clone()), (None, tensor)]))]
    assert bucket_bytes([0, buckets, None]) == {"/ckpt/__0_0.distcp": 43, "/ckpt/__0_1.distcp": 48}
    assert bucket_bytes([0, [], None, "x"]) == {}


def _megatron_core_worker_writes(path, queue):
    """What megatron-core's worker does with a file: its module's ``open``, a write, the fsync."""
    from megatron.core.dist_checkpointing.strategies import filesystem_async
    with filesystem_async.open(path, "wb") as f:
        f.write(os.urandom(3 * paced_file.PIECE // 2))
        os.fsync(f.fileno())
        queue.put(type(f).__name__)


@pytest.mark.skipif(paced_flush.sync_file_range() is None, reason="no sync_file_range here (Linux only)")
def test_in_a_forked_writer_megatron_cores_files_are_paced_files_and_the_ranks_open_stays(tmp_path):
    from megatron.core.dist_checkpointing.strategies import filesystem_async
    report = str(tmp_path / "report")
    written = _in_a_forked_writer(_megatron_core_worker_writes, _pacing(tmp_path, report), str(tmp_path / "f"))
    assert written == "PacedFile"
    assert os.path.getsize(tmp_path / "f") == 3 * paced_file.PIECE // 2
    assert paced_file.read_report(report).startswith("1 files flushed paced (0.050 GB in 2 pieces")
    assert "open" not in vars(filesystem_async)  # the rank's module still has the builtin
