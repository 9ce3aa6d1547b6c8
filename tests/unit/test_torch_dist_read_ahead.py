"""The torch_dist files' read-ahead at a load (checkpoint.torch_dist_read_ahead): each node reads the
files written by its own ranks and no other node's, by one rank; every byte of them once and nothing
else; it stops when told, with no thread left reading, and an error never reaches the caller; it
skips files beyond its share of the node's available memory. The reads are counted where they happen
(``read_piece``) and checked against the files' bytes."""

import os
import threading
import time

import pytest
from hypothesis import given, settings, strategies as st

from megatron.training.checkpoint import torch_dist_read_ahead as read_ahead
from megatron.training.checkpoint.torch_dist_read_ahead import (FilesReadAhead, TorchDistReadAhead,
                                                                files_written_by, ranks_on_node)
from tests.unit.helpers import megatron_world_of_one

OTHER_FILES = [".metadata", "common.pt", "metadata.json", "__0_0.distcp.tmp", "x__1_0.distcp", "__a_0.distcp"]


@settings(max_examples=200, deadline=None)
@given(nodes=st.integers(1, 6), ranks_per_node=st.integers(1, 8), files_per_rank=st.integers(1, 4),
       cyclic=st.booleans(), saved_world_smaller=st.integers(0, 3))
def test_each_node_picks_its_own_ranks_files_and_every_file_is_picked_by_one_reader(
        nodes, ranks_per_node, files_per_rank, cyclic, saved_world_smaller):
    world = nodes * ranks_per_node
    # Ranks placed on nodes in blocks (torchrun) or round robin (srun --distribution=cyclic).
    keys = [(str(r % nodes if cyclic else r // ranks_per_node), "host") for r in range(world)]
    saved_world = max(1, world - saved_world_smaller)  # files of ranks that no longer run are read by none
    names = [f"__{r}_{k}.distcp" for r in range(saved_world) for k in range(files_per_rank)] + OTHER_FILES
    picked_by_readers = []
    for rank in range(world):
        node = ranks_on_node(keys, rank)
        assert rank in node and all(keys[r] == keys[rank] for r in node)
        assert len(node) == ranks_per_node and node == sorted(node)
        files = files_written_by(names, node)
        assert sorted(files) == sorted(f"__{r}_{k}.distcp" for r in node if r < saved_world
                                       for k in range(files_per_rank))
        # every rank's first file before any rank's second (the node's ranks read theirs at once)
        ks = [int(name.split("_")[3].split(".")[0]) for name in files]
        assert ks == sorted(ks)
        if rank == node[0]:
            picked_by_readers += files
    assert sorted(picked_by_readers) == sorted(n for n in names if n not in OTHER_FILES)  # each once


class CountingReadAhead(FilesReadAhead):
    """Records each read (file, offset, bytes) and checks the bytes against the file's."""

    def __init__(self, sizes, contents, delay=0.0, fail_at=None, most=None, **kwargs):
        super().__init__(sizes, **kwargs)
        self.contents, self.delay, self.fail_at = contents, delay, fail_at
        self.most = most  # the most bytes one read returns: short reads, as a file system may give
        self.reads, self.errors = [], []
        self.reads_lock = threading.Lock()

    def read_piece(self, fd, buffer, offset):
        with self.reads_lock:
            if self.fail_at is not None and len(self.reads) == self.fail_at:
                raise OSError(5, "Input/output error")
        time.sleep(self.delay)
        n = super().read_piece(fd, buffer[:self.most], offset)
        path = os.readlink(f"/proc/self/fd/{fd}")
        if bytes(buffer[:n]) != self.contents[path][offset:offset + n]:
            self.errors.append((path, offset, n))
        with self.reads_lock:
            self.reads.append((path, offset, n))
        return n


def make_files(root, sizes, seed=0):
    """Files of ``sizes`` bytes (random contents) under ``root``: [(path, size)] and {path: bytes}."""
    rng = __import__("random").Random(seed)
    made, contents = [], {}
    for i, size in enumerate(sizes):
        path = str(root / f"__{i}_0.distcp")
        data = bytes(rng.getrandbits(8) for _ in range(size))
        with open(path, "wb") as f:
            f.write(data)
        made.append((os.path.realpath(path), size))
        contents[os.path.realpath(path)] = data
    return made, contents


def wait_for(reading, seconds=20.0):
    """Until ``reading``'s threads end by themselves (every piece taken, or an error), or ``seconds`` passed."""
    for thread in list(threading.enumerate()):
        if thread.name.startswith("ckpt-read-ahead"):
            thread.join(seconds)


def no_reader_threads():
    return not any(t.name.startswith("ckpt-read-ahead") for t in threading.enumerate())


@settings(max_examples=40, deadline=None)
@given(sizes=st.lists(st.integers(0, 300), min_size=1, max_size=6), piece=st.integers(1, 64),
       threads=st.integers(1, 4), most=st.none() | st.integers(1, 64))
def test_every_byte_of_the_given_files_is_read_once_and_nothing_else(tmp_path_factory, sizes, piece, threads, most):
    root = tmp_path_factory.mktemp("files")
    made, contents = make_files(root, sizes + [50])
    given_files, left_out = made[:-1], made[-1][0]  # a file beside them that is not given
    reading = CountingReadAhead(given_files, contents, piece_bytes=piece, threads=threads, most=most).start()
    wait_for(reading)
    reading.stop()
    assert no_reader_threads()
    assert reading.failure is None and reading.errors == [] and reading.finished
    assert left_out not in {path for path, _, _ in reading.reads}
    for path, size in given_files:
        ranges = sorted((offset, n) for p, offset, n in reading.reads if p == path)
        assert sum(n for _, n in ranges) == size  # every byte, none twice
        assert all(a + n == b for (a, n), (b, _) in zip(ranges, ranges[1:]))
        assert all(n <= min(piece, most or piece) for _, n in ranges)
    assert reading.bytes_read == reading.total == sum(sizes)


def test_stop_ends_the_reading_at_once_with_no_thread_left(tmp_path):
    made, contents = make_files(tmp_path, [4000, 4000])
    reading = CountingReadAhead(made, contents, delay=0.005, piece_bytes=10, threads=3).start()
    time.sleep(0.05)
    started = time.perf_counter()
    reading.stop()
    assert time.perf_counter() - started < 0.5
    assert no_reader_threads()  # so nothing is read after stop() returned
    assert 0 < reading.bytes_read < reading.total and not reading.finished


def test_an_error_ends_the_reading_quietly_and_is_kept(tmp_path, caplog):
    made, contents = make_files(tmp_path, [500, 500])
    reading = CountingReadAhead(made, contents, fail_at=3, piece_bytes=10, threads=2).start()
    wait_for(reading)
    reading.stop()  # does not raise
    assert no_reader_threads()
    assert reading.failure == "OSError: [Errno 5] Input/output error" and not reading.finished
    assert reading.bytes_read < reading.total
    assert [r.getMessage() for r in caplog.records] == [
        "torch_dist files' read-ahead stopped: OSError: [Errno 5] Input/output error"]


def test_files_beyond_the_memory_share_are_not_read_ahead(tmp_path, monkeypatch):
    made, _ = make_files(tmp_path, [3000, 1000, 0])  # ranks 0, 1, 2: 4000 bytes of rank 0's and 1's
    monkeypatch.setattr(read_ahead, "meminfo_bytes", lambda field: int(4000 / read_ahead.READ_AHEAD_MEMORY_SHARE) - 1)
    skipping = TorchDistReadAhead(str(tmp_path))
    assert skipping.read_ahead_for([0, 1]) is None
    assert skipping.skipped == "their 0.00 MB exceed 50% of the node's 0.01 MB of available memory"
    monkeypatch.setattr(read_ahead, "meminfo_bytes", lambda field: int(4000 / read_ahead.READ_AHEAD_MEMORY_SHARE))
    reading = TorchDistReadAhead(str(tmp_path)).read_ahead_for([0, 1])
    reading.stop()
    assert reading.total == 4000


@pytest.fixture(scope="module")
def world_of_one():
    yield from megatron_world_of_one()


@pytest.mark.parametrize("enabled", [True, False])
def test_at_a_load_the_node_reads_its_ranks_files_until_the_block_ends(tmp_path, world_of_one, enabled):
    made, _ = make_files(tmp_path, [5000, 700])  # rank 0's and rank 1's
    (tmp_path / "__0_1.distcp").write_bytes(b"x" * 300)
    (tmp_path / "common.pt").write_bytes(b"y" * 100)
    with TorchDistReadAhead(str(tmp_path), enabled=enabled) as load:
        reading = load.reading
        if reading is not None:
            wait_for(reading)
    assert no_reader_threads()
    if not enabled:
        assert reading is None and load.summary() == ""
        return
    assert reading.bytes_read == reading.total == 5300  # rank 0's files only: this world has no rank 1
    assert load.summary().startswith("; torch_dist files read ahead on this node: 0.01 MB in ")
    assert load.summary().endswith(" s on 2 threads (whole)")


def test_a_read_ahead_that_cannot_start_does_not_fail_the_load(tmp_path, world_of_one, caplog):
    with TorchDistReadAhead(str(tmp_path / "missing")) as load:
        pass
    assert load.reading is None and "failed to start (FileNotFoundError" in load.summary()
    assert no_reader_threads()
