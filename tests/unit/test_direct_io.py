"""The checkpoint files' direct I/O. The writer's regions (DirectRegionWriter): written in any order at any byte offset, cut into
pieces across a small ring of staging buffers, with O_DIRECT for whole blocks and the page cache for
the ends (or for all of it where the file system has no O_DIRECT): the file holds exactly the bytes,
and each tensor's CRC32 is zlib's over its bytes. The reader's ranges (DirectReads): the file's
bytes, short where the file ends."""

import os
import random
import zlib

import pytest
import torch
from hypothesis import given, settings, strategies as st

from mlp_offload.tiers import direct_io
from mlp_offload.tiers.direct_io import DirectReads, DirectRegionWriter
from tests.profiles import examples

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


def _write_and_check(path, start, end, order):
    with open(path, "wb") as f:
        f.write(b"\xab" * start)  # bytes before the regions stay as they were
        f.flush()
        writer = DirectRegionWriter(f.fileno(), str(path), threads=3)
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
    monkeypatch.setattr(direct_io, "RING", 3)


@pytest.fixture(scope="module")
def small_ring():
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(direct_io, "PIECE", 3 * 4096)
        patch.setattr(direct_io, "RING", 3)
        yield


@settings(max_examples=examples(60), deadline=None, derandomize=True, print_blob=True)
@given(case=regions())
def test_regions_land_byte_for_byte_with_their_crcs(tmp_path_factory, small_ring, case):
    _write_and_check(tmp_path_factory.mktemp("dw") / "f", *case)


def test_without_o_direct_everything_goes_through_the_page_cache(tmp_path, small_pieces, monkeypatch):
    monkeypatch.setattr(direct_io, "open_direct", lambda path, flags: None)
    gen = random.Random(1)
    tensors = [torch.randn(gen.randint(1, 20_000)) for _ in range(3)]
    _write_and_check(tmp_path / "f", 100, 100 + sum(t.numel() * 4 for t in tensors), [(100, tensors)])


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
    finally:
        reads.close()


@pytest.fixture(scope="module")
def small_chunks():
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(direct_io, "CHUNK", 2 * 4096)  # several reads per range, in parallel
        yield
