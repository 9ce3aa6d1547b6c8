"""Streaming engine checkpoints: bit-identical continuation, whatever the new layout; damage detected."""

import json
import os
import struct
import zlib

import pytest
import torch
from hypothesis import given, settings, strategies as st

from mlp_offload import OffloadedAdamW, faults
from mlp_offload.checkpoint import (MAGIC, TRAILER, CheckpointDataError, CheckpointSaveError, RangeReader,
                                    load_engine_state, read_footer)
from mlp_offload.checkpoint.write import save_engine_state
from mlp_offload.tiers import direct_io

from tests.profiles import examples

from .helpers import bf16_grads, engine_state, fast_config, run_steps

NUMEL = 70_001


def grads(seed, steps):
    return bf16_grads(seed, steps, NUMEL)


run = run_steps


@pytest.mark.parametrize("resume", [
    dict(tiers=["nvme", "pfs"], subgroup_size=9_000),                                  # other paths
    dict(tiers=["host"], subgroup_size=25_000),                                       # host only
    dict(tiers=["host", "pfs"], subgroup_size=7_000, host_budget_bytes=6 * 3 * 28672),  # other budget
])
def test_resume_is_bit_identical(tmp_path, resume):
    init = torch.randn(NUMEL, generator=torch.Generator().manual_seed(1))
    g = grads(2, 5)
    with OffloadedAdamW(init.clone(), fast_config(tmp_path / "ref", tiers=["nvme"], subgroup_size=10_000)) as ref:
        run(ref, g)
        expected = engine_state(ref)

    first = OffloadedAdamW(init.clone(), fast_config(tmp_path / "a", tiers=["host", "nvme"], subgroup_size=10_000,
                                                     host_budget_bytes=7 * 3 * 40960))
    run(first, g[:3])
    ckpt = str(tmp_path / "engine.ckpt")
    save_engine_state(first, ckpt, metadata={"iteration": 3})
    first.close()

    with OffloadedAdamW(torch.zeros(NUMEL), fast_config(tmp_path / "b", **resume)) as second:
        assert load_engine_state(second, ckpt) == {"iteration": 3}
        assert second.steps_done == 3
        run(second, g[3:])
        got = engine_state(second)
    for a, b in zip(got, expected):
        assert torch.equal(a, b)


def _saved(tmp_path):
    with OffloadedAdamW(torch.randn(NUMEL), fast_config(tmp_path, tiers=["nvme"])) as eng:
        run(eng, grads(0, 2))
        path = str(tmp_path / "x.ckpt")
        save_engine_state(eng, path)
    return path


def test_truncated_checkpoint(tmp_path):
    path = _saved(tmp_path)
    os.truncate(path, os.path.getsize(path) // 2)
    with pytest.raises(CheckpointDataError, match="not a complete offload checkpoint"):
        read_footer(path)


@settings(max_examples=examples(12), deadline=None, derandomize=True, print_blob=True)
@given(at=st.integers(0, 4 * 10_000 - 1))
def test_damage_anywhere_in_a_tensor_read_in_many_chunks_is_caught(tmp_path_factory, at):
    """A stored tensor read by O_DIRECT in several chunks, its CRC taken as they land: a byte changed in
    any chunk is caught."""
    root = tmp_path_factory.mktemp("chunks")
    path = _saved(root)
    with open(path, "r+b") as f:
        f.seek(2 * 12 * 10_000 + 4 * 10_000 + at)  # exp_avg of the third stored subgroup
        byte = f.read(1)
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([byte[0] ^ 0x5A]))
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(direct_io, "CHUNK", 2 * 4096)  # exp_avg's 40 kB in five reads
        with OffloadedAdamW(torch.zeros(NUMEL), fast_config(root / "b", tiers=["host"])) as eng:
            with pytest.raises(CheckpointDataError, match="checksum mismatch in exp_avg of elements 20000..30000"):
                load_engine_state(eng, path)


def test_corrupt_checkpoint_is_not_loaded(tmp_path):
    path = _saved(tmp_path)
    with open(path, "r+b") as f:
        f.seek(2 * 12 * 10_000 + 4 * 10_000 + 123)  # inside exp_avg of the third stored subgroup
        f.write(b"\xff\xff")
    with OffloadedAdamW(torch.zeros(NUMEL), fast_config(tmp_path / "b", tiers=["host"])) as eng:
        with pytest.raises(CheckpointDataError, match="checksum mismatch in exp_avg of elements 20000..30000"):
            load_engine_state(eng, path)


def test_wrong_shard_size(tmp_path):
    path = _saved(tmp_path)
    with OffloadedAdamW(torch.zeros(NUMEL + 1), fast_config(tmp_path / "b", tiers=["host"])) as eng:
        with pytest.raises(CheckpointDataError, match="holds 70001 elements but this rank's shard has 70002"):
            load_engine_state(eng, path)


def test_crash_while_saving_leaves_previous_file(tmp_path, monkeypatch):
    path = _saved(tmp_path)
    before = open(path, "rb").read()
    with OffloadedAdamW(torch.randn(NUMEL), fast_config(tmp_path / "b", tiers=["nvme"])) as eng:
        def boom(*a, **k):
            raise OSError("disk full")
        monkeypatch.setattr(os, "fsync", boom)
        with pytest.raises(OSError, match="disk full"):
            save_engine_state(eng, path)
    assert open(path, "rb").read() == before


def _footer_parts(path):
    data = open(path, "rb").read()
    magic, length, crc = TRAILER.unpack(data[-TRAILER.size:])
    assert magic == MAGIC
    return data[: len(data) - TRAILER.size - length], data[len(data) - TRAILER.size - length: -TRAILER.size]


def _with_metadata(tmp_path):
    with OffloadedAdamW(torch.randn(NUMEL), fast_config(tmp_path, tiers=["nvme"])) as eng:
        run(eng, grads(0, 1))
        path = str(tmp_path / "m.ckpt")
        save_engine_state(eng, path, metadata={"params": [["0.weight", 0, 70_001, 0]]})
    return path


def test_edited_footer_digit_is_refused(tmp_path):
    """One digit of a per-parameter offset changed, the JSON still valid: the footer's CRC catches it."""
    path = _with_metadata(tmp_path)
    body, footer = _footer_parts(path)
    edited = footer.replace(b'"0.weight", 0, 70001', b'"0.weight", 1, 70001')
    assert edited != footer and json.loads(edited)
    with open(path, "wb") as f:
        f.write(body + edited + TRAILER.pack(MAGIC, len(edited), zlib.crc32(footer)))
    with pytest.raises(CheckpointDataError, match="checksum mismatch in the footer"):
        read_footer(path)


@pytest.mark.parametrize("edit,why", [
    (lambda f: f["subgroups"][1].update(offset=f["subgroups"][1]["offset"] + 4), "expected to start at element"),
    (lambda f: f["subgroups"].pop(), "cover 70000 of 70001 elements"),
    (lambda f: f.update(numel=70_002), "cover 70001 of 70002 elements"),
    (lambda f: f["subgroups"][0].update(crc=[1, 2]), "malformed subgroup entry"),
    (lambda f: f.update(steps_done=-1), "steps_done -1"),
])
def test_inconsistent_footer_with_a_valid_checksum_is_refused(tmp_path, edit, why):
    """A footer re-signed after an edit (or written by a bug) is still checked against the data."""
    path = _with_metadata(tmp_path)
    body, footer = _footer_parts(path)
    parsed = json.loads(footer)
    edit(parsed)
    new = json.dumps(parsed).encode()
    with open(path, "wb") as f:
        f.write(body + new + TRAILER.pack(MAGIC, len(new), zlib.crc32(new)))
    with pytest.raises(CheckpointDataError, match=f"footer is inconsistent.*{why}"):
        read_footer(path)


def test_a_footer_without_its_checksum_is_refused(tmp_path):
    """The trailer of the first format (magic, length, no CRC): nothing unchecked is followed."""
    path = _with_metadata(tmp_path)
    body, footer = _footer_parts(path)
    with open(path, "wb") as f:
        f.write(body + footer + struct.pack("<8sQ", b"MLPOFFv1", len(footer)))
    with pytest.raises(CheckpointDataError, match="not a complete offload checkpoint"):
        read_footer(path)


def test_disk_full_while_saving_names_the_file_and_removes_it(tmp_path, monkeypatch):
    path = _saved(tmp_path)
    before = open(path, "rb").read()
    monkeypatch.setattr(faults, "_passes", {})
    monkeypatch.setattr(faults, "_fault", "save-offload#3=ENOSPC")
    with OffloadedAdamW(torch.randn(NUMEL), fast_config(tmp_path / "b", tiers=["nvme"])) as eng:
        with pytest.raises(CheckpointSaveError, match=r"x.ckpt: No space left on device.*0.84 MB needed for this "
                                                      r"file, .* GB free; the partial file was removed"):
            save_engine_state(eng, path)
    assert open(path, "rb").read() == before
    assert not os.path.exists(path + ".tmp")


def test_a_bounded_reader_reads_ranges_and_still_checks_every_tensor(tmp_path):
    """With a cache budget below a stored tensor (10 000 elements, 40 KB each here) the reader checks
    each tensor's CRC by streaming it once and then reads only the ranges asked for: the same
    numbers as the caching reader; a damaged tensor is refused before any of it is used."""
    path = _saved(tmp_path)
    footer = read_footer(path)
    whole, bounded = RangeReader(path, footer["subgroups"]), RangeReader(path, footer["subgroups"], cache_bytes=60_000)
    for start, end in [(0, 70_001), (9_990, 10_020), (35_000, 35_001), (12_345, 61_000)]:
        for k in range(3):
            a, b = torch.empty(end - start), torch.empty(end - start)
            whole.read(k, start, end, a)
            bounded.read(k, start, end, b)
            assert torch.equal(a, b)
    assert all(6 * n * 4 <= 60_000 for n in bounded.cached_elements)  # only the 1-element tail
    whole.close()
    bounded.close()
    with open(path, "r+b") as f:
        f.seek(2 * 12 * 10_000 + 4 * 10_000 + 123)  # inside exp_avg of the third stored subgroup
        f.write(b"\xff\xff")
    with RangeReader(path, footer["subgroups"], cache_bytes=60_000) as damaged, \
            pytest.raises(CheckpointDataError, match="checksum mismatch in exp_avg of elements 20000..30000"):
        damaged.read(1, 25_000, 25_010, torch.empty(10))


def _stored_tensor(path, footer, e, k):
    """Stored tensor ``k`` of entry ``e`` read plainly from the file (fp32 state here)."""
    n = e["end"] - e["start"]
    with open(path, "rb") as f:
        f.seek(e["offset"] + 4 * n * k)
        return torch.frombuffer(bytearray(f.read(4 * n)), dtype=torch.float32)


def test_the_read_ahead_serves_a_resume_in_file_order_and_checks_what_it_read(tmp_path):
    """Read in the file's order (a resume), every stored tensor after the first comes from the read
    ahead, with the numbers a plain read of the file gives; read backwards, none does; a damaged
    tensor read ahead is refused when it is asked for, with its name."""
    path = _saved(tmp_path)
    footer = read_footer(path)
    entries = sorted(footer["subgroups"], key=lambda e: e["offset"])
    with RangeReader(path, footer["subgroups"]) as forward:
        for e in entries:
            for k in range(3):
                got = torch.empty(e["end"] - e["start"])
                forward.read(k, e["start"], e["end"], got)
                assert torch.equal(got, _stored_tensor(path, footer, e, k))
        assert forward.read_ahead_used == 3 * len(entries) - 1
    with RangeReader(path, footer["subgroups"]) as backward:
        for e in reversed(entries):
            for k in reversed(range(3)):
                got = torch.empty(e["end"] - e["start"])
                backward.read(k, e["start"], e["end"], got)
                assert torch.equal(got, _stored_tensor(path, footer, e, k))
        assert backward.read_ahead_used == 0
    second = entries[1]
    with open(path, "r+b") as f:
        f.seek(second["offset"] + 17)  # inside the second stored subgroup's param
        f.write(b"\xff\xff")
    with RangeReader(path, footer["subgroups"]) as damaged:
        first = entries[0]
        for k in range(3):
            damaged.read(k, first["start"], first["end"], torch.empty(first["end"] - first["start"]))
        with pytest.raises(CheckpointDataError, match=f"checksum mismatch in param of elements {second['start']}"):
            damaged.read(0, second["start"], second["end"], torch.empty(second["end"] - second["start"]))
        assert damaged.read_ahead_used == 3
