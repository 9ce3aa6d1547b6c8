"""The checkpoint files' direct I/O. The writer's regions (DirectRegionWriter): written in any order at any byte offset, cut into
pieces across a small ring of staging buffers, with O_DIRECT for whole blocks and the page cache for
the ends (or for all of it where the file system has no O_DIRECT): the file holds exactly the bytes,
and each tensor's CRC32 is zlib's over its bytes, whether a helper process or threads of this one
make the writes. A write's failure reaches the writer as its OSError, a helper's death as one clear
error. The reader's ranges (DirectReads): the file's bytes, short where the file ends."""

import logging
import os
import random
import signal
import subprocess
import sys
import time
import zlib
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings, strategies as st

from mlp_offload.tiers import direct_io
from mlp_offload.tiers.direct_io import DirectReads, DirectRegionWriter
from mlp_offload.tiers.write_helper import HelperFailed, WriteHelper
from tests.profiles import examples

ROOT = Path(__file__).resolve().parents[2]
DTYPES = [torch.float32, torch.bfloat16, torch.int16, torch.uint8]


@st.composite
def regions(draw):
    """Back-to-back regions of one to three tensors each, from byte ``start``; their write order."""
    start = draw(st.integers(0, 3 * 4096))
    out, pos = [], start
    for _ in range(draw(st.integers(1, 6))):
        tensors = [torch.randint(-100, 100, (draw(st.integers(1, 9000)),)).to(draw(st.sampled_from(DTYPES)))
                   for _ in range(draw(st.integers(1, 3)))]
        out.append((pos, tensors))
        pos += sum(t.numel() * t.element_size() for t in tensors)
    order = draw(st.permutations(range(len(out))))
    return start, pos, [out[k] for k in order]


def _write_and_check(path, start, end, order, helper=True):
    with open(path, "wb") as f:
        f.write(b"\xab" * start)  # bytes before the regions stay as they were
        f.flush()
        writer = DirectRegionWriter(f.fileno(), str(path), threads=3, helper=helper)
        try:
            crcs = [(tensors, writer.put(offset, tensors)) for offset, tensors in order]
            writer.finish()
        finally:
            writer.close()
    data = path.read_bytes()
    assert len(data) == end and data[:start] == b"\xab" * start
    for (offset, tensors), (_, crc) in zip(order, crcs):
        pos = offset
        for t, c in zip(tensors, crc()):
            raw = t.view(torch.uint8).numpy().tobytes()
            assert data[pos: pos + len(raw)] == raw
            assert c == zlib.crc32(raw)
            pos += len(raw)


@pytest.fixture
def small_pieces(monkeypatch):
    monkeypatch.setattr(direct_io, "PIECE", 3 * 4096)
    monkeypatch.setattr(direct_io, "STAGE", 4 * 4096)
    monkeypatch.setattr(direct_io, "RING", 3)


@pytest.fixture(scope="module")
def small_ring():
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(direct_io, "PIECE", 3 * 4096)
        patch.setattr(direct_io, "STAGE", 4 * 4096)
        patch.setattr(direct_io, "RING", 3)
        yield


@pytest.mark.parametrize("in_helper", [True, False], ids=["helper", "threads"])
@settings(max_examples=examples(60), deadline=None, derandomize=True, print_blob=True)
@given(case=regions())
def test_regions_land_byte_for_byte_with_their_crcs(tmp_path_factory, small_ring, in_helper, case):
    _write_and_check(tmp_path_factory.mktemp("dw") / "f", *case, helper=in_helper)


@pytest.mark.parametrize("in_helper", [True, False], ids=["helper", "threads"])
def test_without_o_direct_everything_goes_through_the_page_cache(tmp_path, small_pieces, monkeypatch, in_helper):
    monkeypatch.setattr(direct_io, "open_direct", lambda path, flags: None)
    gen = random.Random(1)
    tensors = [torch.randn(gen.randint(1, 20_000)) for _ in range(3)]
    _write_and_check(tmp_path / "f", 100, 100 + sum(t.numel() * 4 for t in tensors), [(100, tensors)],
                     helper=in_helper)


def test_a_failed_write_is_raised_to_the_writer(tmp_path, small_pieces, monkeypatch):
    def full(fd, data, offset):
        raise OSError(28, os.strerror(28))

    monkeypatch.setattr(direct_io, "pwrite_all", full)
    with open(tmp_path / "f", "wb") as f:
        writer = DirectRegionWriter(f.fileno(), str(tmp_path / "f"), threads=2)
        try:
            with pytest.raises(OSError, match="No space"):
                for k in range(8):
                    writer.put(k * 40_000, [torch.randn(10_000)])
                writer.finish()
        finally:
            writer.close()


def test_a_full_disk_under_the_helper_is_raised_as_no_space_and_the_helper_exits(small_pieces):
    fd = os.open("/dev/full", os.O_WRONLY)  # every write: ENOSPC
    writer = DirectRegionWriter(fd, "/dev/full", threads=2, helper=True)
    try:
        assert writer.helper is not None
        with pytest.raises(OSError) as raised:
            for k in range(8):
                writer.put(k * 40_000, [torch.randn(10_000)])
            writer.finish()
        assert raised.value.errno == 28
    finally:
        writer.close()
        os.close(fd)
    assert writer.helper.process.returncode == 0


def test_a_helper_killed_mid_save_is_one_clear_error(tmp_path, small_pieces):
    with open(tmp_path / "f", "wb") as f:
        writer = DirectRegionWriter(f.fileno(), str(tmp_path / "f"), threads=2, helper=True)
        try:
            writer.put(0, [torch.randn(10_000)])
            writer.helper.process.send_signal(signal.SIGKILL)
            writer.helper.process.wait()
            with pytest.raises(HelperFailed, match=r"write helper \(pid \d+\) ended with exit code -9 before"):
                for k in range(1, 8):
                    writer.put(k * 40_000, [torch.randn(10_000)])
                writer.finish()
        finally:
            writer.close()


def test_where_no_helper_starts_the_writes_run_in_threads_and_the_log_says_so_once(tmp_path, small_pieces,
                                                                                    monkeypatch, caplog):
    def refused(*args, **kwargs):
        raise OSError(11, "Resource temporarily unavailable")

    monkeypatch.setattr(direct_io, "_helper_refused", False)
    monkeypatch.setattr(WriteHelper, "start", refused)
    tensors = [torch.randn(20_000)]
    with caplog.at_level(logging.WARNING, logger="mlp_offload"):
        for name in ("a", "b"):
            _write_and_check(tmp_path / name, 0, 80_000, [(0, tensors)])
    warnings = [r.getMessage() for r in caplog.records if "write helper" in r.getMessage()]
    assert warnings == ["checkpoint writes run in threads of the training process: no write helper "
                        "([Errno 11] Resource temporarily unavailable)"]


@settings(max_examples=examples(40), deadline=None, derandomize=True, print_blob=True)
@given(size=st.integers(1, 5 * 4096 + 17), ranges=st.lists(st.tuples(st.integers(0, 6 * 4096), st.integers(0, 3 * 4096)),
                                                         min_size=1, max_size=6))
def test_direct_reads_give_the_files_bytes_and_stop_at_its_end(tmp_path_factory, small_chunks, size, ranges):
    path = tmp_path_factory.mktemp("dr") / "f"
    data = os.urandom(size)
    path.write_bytes(data)
    reads = DirectReads(str(path), threads=2)
    try:
        for offset, nbytes in ranges:
            got = reads.read(offset, nbytes)
            if got is None:  # a file system without O_DIRECT: the caller reads through the page cache
                return
            assert bytes(got) == data[offset: offset + nbytes]
            # fed as the chunks land, in order: the pieces are the bytes handed out
            pieces = []
            got = reads.read(offset, nbytes, feed=lambda piece: pieces.append(bytes(piece)))
            assert bytes(got) == data[offset: offset + nbytes] == b"".join(pieces)
    finally:
        reads.close()


@pytest.fixture(scope="module")
def small_chunks():
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(direct_io, "CHUNK", 2 * 4096)  # several reads per range, in parallel
        yield


KILLED_RANK = """
import os, signal, sys, torch
from mlp_offload.tiers.direct_io import DirectRegionWriter
f = open(sys.argv[1], "wb")
writer = DirectRegionWriter(f.fileno(), sys.argv[1], threads=2, helper=True)
writer.put(0, [torch.randn(1 << 20)])
print(writer.helper.process.pid, flush=True)
os.kill(os.getpid(), signal.SIGKILL)
"""


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"  # a zombie has exited
    except FileNotFoundError:
        return False


@pytest.mark.skipif(not os.path.isdir("/proc/self"), reason="reads /proc")
def test_a_killed_ranks_write_helper_exits(tmp_path):
    env = {**os.environ, "PYTHONPATH": str(ROOT), "PYTHONWARNINGS": "ignore"}
    rank = subprocess.run([sys.executable, "-c", KILLED_RANK, str(tmp_path / "f")], env=env, capture_output=True,
                          text=True, timeout=120)
    assert rank.returncode == -9, rank.stderr[-2000:]
    helper = int(rank.stdout.split()[0])
    deadline = time.monotonic() + 10
    while _alive(helper) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not _alive(helper), f"the write helper {helper} outlived its killed rank by 10 s"


def test_closing_ends_the_helper_while_a_forked_child_holds_the_ranks_socket(tmp_path, small_pieces):
    import multiprocessing
    with open(tmp_path / "f", "wb") as f:
        writer = DirectRegionWriter(f.fileno(), str(tmp_path / "f"), threads=2, helper=True)
        child = multiprocessing.get_context("fork").Process(target=time.sleep, args=(60,))
        child.start()  # a copy of every descriptor of this process, the helper's socket included
        try:
            crcs = writer.put(0, [torch.arange(30_000, dtype=torch.int32)])
            writer.finish()
            started = time.monotonic()
            writer.close()
            assert time.monotonic() - started < 5 and writer.helper.process.returncode == 0
            assert crcs() == [zlib.crc32(torch.arange(30_000, dtype=torch.int32).numpy().tobytes())]
        finally:
            child.kill()
            child.join()


def test_a_helper_whose_rank_is_gone_before_its_descriptors_exits_quietly():
    import socket
    from mlp_offload.tiers import write_helper
    ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    helper = subprocess.Popen([sys.executable, "-I", "-S", write_helper.__file__, str(theirs.fileno())],
                              pass_fds=[theirs.fileno()], stderr=subprocess.PIPE)
    theirs.close()
    ours.close()
    assert helper.wait(30) == 0 and helper.stderr.read() == b""  # no traceback in the rank's log


def test_a_helper_that_cannot_start_leaves_the_writes_to_threads_and_says_so(tmp_path, small_pieces, monkeypatch,
                                                                                caplog):
    from mlp_offload.tiers import write_helper
    monkeypatch.setattr(direct_io, "_helper_refused", False)
    monkeypatch.setattr(write_helper, "__file__", str(tmp_path / "no_such_helper.py"))  # the interpreter exits 2
    with caplog.at_level(logging.WARNING, logger="mlp_offload"):
        _write_and_check(tmp_path / "f", 0, 80_000, [(0, [torch.randn(20_000)])])
    assert [r.getMessage() for r in caplog.records if "write helper" in r.getMessage()] == [
        "checkpoint writes run in threads of the training process: no write helper (it did not start: exit code 2)"]
