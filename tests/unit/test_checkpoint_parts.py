"""Checkpoints that take tier files by hard link (``checkpoint.parts``): the part files are the tier's own
inodes at save time and never change afterwards; loads (also of a copied checkpoint, also resharded) are
bit-identical to what the engine held; damage, a refused link and a crash before the rename are handled."""

import errno
import hashlib
import os
import shutil
import tempfile
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings, strategies as st

from mlp_offload import OffloadedAdamW, faults
from mlp_offload.checkpoint import CheckpointDataError, RangeReader, load_engine_state, read_footer
from mlp_offload.checkpoint.parts import is_part_path, parts_dir
from mlp_offload.checkpoint.write import save_engine_state, start_background_save
from mlp_offload.tiers import direct_io
from tests.profiles import examples

from .helpers import bf16_grads, engine_state, fast_config, run_steps
from .test_state_digest import cases, fixed_case, load_with_digests, save_with_digests

NUMEL = 70_001
HOST_TWO = 2 * 3 * 40960  # host budget for two subgroups of 10 000 fp32 elements


def _engine(root, tiers=("host", "nvme"), numel=NUMEL, **options):
    options.setdefault("host_budget_bytes", HOST_TWO if "host" in tiers else None)
    if options["host_budget_bytes"] is None:
        del options["host_budget_bytes"]
    return OffloadedAdamW(torch.randn(numel, generator=torch.Generator().manual_seed(5)),
                          fast_config(root, tiers=list(tiers), **options))


def _parts(path):
    """(footer entry, absolute part path) of each linked subgroup of state file ``path``."""
    base = os.path.dirname(path)
    return [(e, os.path.join(base, e["part"]["file"])) for e in read_footer(path)["subgroups"] if "part" in e]


def _tier_files(root):
    """File name -> path of the tier files (not a snapshot's links) under ``root``."""
    found = {}
    for dirpath, _, names in os.walk(root):
        if os.path.basename(dirpath) != "snapshot":
            found.update({n: os.path.join(dirpath, n) for n in names if n.endswith(".state")})
    return found


def _digest(paths):
    return {p: hashlib.sha256(open(p, "rb").read()).hexdigest() for p in paths}


def _loaded(path, root, tiers=("host",), **options):
    with OffloadedAdamW(torch.zeros(NUMEL), fast_config(root, tiers=list(tiers), **options)) as eng:
        load_engine_state(eng, path)
        return engine_state(eng)


def _equal(a, b):
    return all(torch.equal(x, y) for x, y in zip(a, b))


def test_a_save_links_the_tier_files_and_the_checkpoint_keeps_its_bytes(tmp_path):
    path = str(tmp_path / "x.offload")
    with _engine(tmp_path / "a") as eng:
        run_steps(eng, bf16_grads(0, 2, NUMEL))
        written = save_engine_state(eng, path, link_tier_files=True)
        expected = engine_state(eng)
        parts = _parts(path)
        assert 0 < len(parts) < 8  # of eight subgroups; those whose newest state is in memory are copied
        assert written == os.path.getsize(path)
        tier = _tier_files(tmp_path / "a" / "nvme")
        for _, part in parts:  # the tier's own file, by a second name: no byte was copied
            st_part, st_tier = os.stat(part), os.stat(tier[os.path.basename(part)])
            assert (st_part.st_ino, st_part.st_nlink) == (st_tier.st_ino, 2)
        before = _digest(p for _, p in parts)
        run_steps(eng, bf16_grads(1, 3, NUMEL))  # the updates write those subgroups to new files
        assert _digest(p for _, p in parts) == before
        for _, part in parts:
            assert os.stat(part).st_nlink == 1
    assert _equal(_loaded(path, tmp_path / "b"), expected)
    copy = tmp_path / "copied"
    shutil.copytree(tmp_path, copy, ignore=shutil.ignore_patterns("a", "b", "copied"))
    shutil.rmtree(tmp_path / "a")  # the training run's tiers gone: the checkpoint does not need them
    assert _equal(_loaded(str(copy / "x.offload"), tmp_path / "c", tiers=("nvme",), subgroup_size=9_000), expected)
    assert _equal(_loaded(path, tmp_path / "d"), expected)


def test_a_background_save_hands_the_snapshots_links_in(tmp_path):
    path = str(tmp_path / "x.offload")
    with _engine(tmp_path / "a", tiers=("nvme",)) as eng:
        run_steps(eng, bf16_grads(0, 2, NUMEL))
        expected = engine_state(eng)
        write = start_background_save(eng, path, link_tier_files=True)
        write.start()
        run_steps(eng, bf16_grads(1, 2, NUMEL))  # training goes on beside the writer
        write.wait()
        assert write.failure is None
        assert 0 < len(_parts(path)) < 8  # the pipeline buffers' newest states are copied
        assert not os.listdir(os.path.join(os.path.dirname(next(iter(_tier_files(tmp_path / "a").values()))),
                                           "snapshot"))  # the snapshot's own links are gone
        after = engine_state(eng)
    assert _equal(_loaded(path, tmp_path / "b"), expected)
    assert not _equal(after, expected)


def test_deleting_the_checkpoint_does_not_touch_training(tmp_path):
    grads = bf16_grads(0, 4, NUMEL)
    with _engine(tmp_path / "ref") as ref:
        run_steps(ref, grads)
        expected = engine_state(ref)
    path = str(tmp_path / "x.offload")
    with _engine(tmp_path / "a") as eng:
        run_steps(eng, grads[:2])
        save_engine_state(eng, path, link_tier_files=True)
        os.unlink(path)
        shutil.rmtree(parts_dir(path))
        run_steps(eng, grads[2:])
        assert _equal(engine_state(eng), expected)


def test_a_damaged_part_file_is_refused_naming_it(tmp_path):
    path = str(tmp_path / "x.offload")
    with _engine(tmp_path / "a") as eng:
        run_steps(eng, bf16_grads(0, 1, NUMEL))
        save_engine_state(eng, path, link_tier_files=True)
    e, part = _parts(path)[2]
    with open(part, "r+b") as f:
        f.seek(e["part"]["spans"][1][0] + 123)  # inside its exp_avg
        byte = f.read(1)
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([byte[0] ^ 0x10]))
    with pytest.raises(CheckpointDataError, match=f"{part}: checksum mismatch in exp_avg of elements "
                                                  f"{e['start']}..{e['end']}"):
        _loaded(path, tmp_path / "b")
    with RangeReader(path, read_footer(path)["subgroups"], cache_bytes=60_000) as bounded, \
            pytest.raises(CheckpointDataError, match="checksum mismatch in exp_avg"):
        bounded.read(1, e["start"] + 5, e["start"] + 10, torch.empty(5))
    os.unlink(part)
    with pytest.raises(CheckpointDataError, match=f"{part}: a part of the offloaded optimizer state is missing"):
        _loaded(path, tmp_path / "c")


@settings(max_examples=examples(12), deadline=None, derandomize=True, print_blob=True)
@given(at=st.floats(0, 1, exclude_max=True))
def test_damage_anywhere_in_a_part_read_in_many_chunks_is_caught(tmp_path_factory, at):
    """A part's span of five tier blocks read by O_DIRECT in ten chunks, its block CRCs taken as they land:
    the part loads as saved, and a byte changed anywhere in it is caught, naming the part file."""
    root = tmp_path_factory.mktemp("chunks")
    path = str(root / "x.offload")
    with _engine(root / "a", io_block_bytes=8192) as eng:
        run_steps(eng, bf16_grads(0, 1, NUMEL))
        save_engine_state(eng, path, link_tier_files=True)
        saved = engine_state(eng)
    e, part = _parts(path)[2]
    assert len(e["part"]["crcs"][1]) == 5
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(direct_io, "CHUNK", 4096)  # the span in many reads
        assert _equal(_loaded(path, root / "b"), saved)
        with open(part, "r+b") as f:
            f.seek(e["part"]["spans"][1][0] + int(at * 4 * (e["end"] - e["start"])))  # inside its exp_avg
            byte = f.read(1)
            f.seek(-1, os.SEEK_CUR)
            f.write(bytes([byte[0] ^ 0x10]))
        with pytest.raises(CheckpointDataError, match=f"{part}: checksum mismatch in exp_avg"):
            _loaded(path, root / "c")


def test_ranges_read_from_parts_equal_those_of_a_copied_checkpoint(tmp_path):
    """Resharding reads ranges across stored subgroups: a linked checkpoint gives the copied one's numbers,
    through the caching reader and the bounded one."""
    linked, copied = str(tmp_path / "l.offload"), str(tmp_path / "c.offload")
    with _engine(tmp_path / "a") as eng:
        run_steps(eng, bf16_grads(0, 2, NUMEL))
        save_engine_state(eng, linked, link_tier_files=True)
        save_engine_state(eng, copied)
    assert _parts(linked) and not _parts(copied)
    for cache in (None, 60_000):
        with RangeReader(linked, read_footer(linked)["subgroups"], cache_bytes=cache) as a, \
                RangeReader(copied, read_footer(copied)["subgroups"], cache_bytes=cache) as b:
            for start, end in [(0, NUMEL), (9_990, 10_020), (35_000, 35_001), (12_345, 61_000)]:
                for k in range(3):
                    x, y = torch.empty(end - start), torch.empty(end - start)
                    a.read(k, start, end, x)
                    b.read(k, start, end, y)
                    assert torch.equal(x, y)


def test_a_refused_link_copies_the_bytes(tmp_path, monkeypatch):
    def refuse(*a, **k):
        raise OSError(errno.EXDEV, "Invalid cross-device link")
    path = str(tmp_path / "x.offload")
    with _engine(tmp_path / "a") as eng:
        run_steps(eng, bf16_grads(0, 2, NUMEL))
        expected = engine_state(eng)
        monkeypatch.setattr(os, "link", refuse)
        save_engine_state(eng, path, link_tier_files=True)
    assert not _parts(path) and not os.path.exists(parts_dir(path))
    assert _equal(_loaded(path, tmp_path / "b"), expected)


def test_a_crash_between_link_and_rename_leaves_the_previous_checkpoint(tmp_path, monkeypatch):
    path = str(tmp_path / "x.offload")
    with _engine(tmp_path / "a") as eng:
        run_steps(eng, bf16_grads(0, 1, NUMEL))
        save_engine_state(eng, path, link_tier_files=True)
        old = engine_state(eng)
        old_parts = sorted(os.listdir(parts_dir(path)))
        run_steps(eng, bf16_grads(1, 1, NUMEL))
        monkeypatch.setattr(faults, "_passes", {})
        monkeypatch.setattr(faults, "_fault", "save-offload-commit=EIO")
        with pytest.raises(OSError, match="injected at save-offload-commit"):
            save_engine_state(eng, path, link_tier_files=True)
        assert not os.path.exists(path + ".tmp")
        assert sorted(os.listdir(parts_dir(path))) == old_parts  # the new save's parts went with it
        monkeypatch.setattr(faults, "_fault", None)
        save_engine_state(eng, path, link_tier_files=True)  # a later save at the path replaces the old parts
        new = engine_state(eng)
        assert len(os.listdir(parts_dir(path))) == 1 and sorted(os.listdir(parts_dir(path))) != old_parts
    assert _equal(_loaded(path, tmp_path / "b"), new) and not _equal(new, old)


def test_a_crash_on_a_first_save_leaves_nothing(tmp_path, monkeypatch):
    path = str(tmp_path / "x.offload")
    monkeypatch.setattr(faults, "_passes", {})
    monkeypatch.setattr(faults, "_fault", "save-offload-commit=EIO")
    with _engine(tmp_path / "a") as eng:
        run_steps(eng, bf16_grads(0, 1, NUMEL))
        with pytest.raises(OSError):
            save_engine_state(eng, path, link_tier_files=True)
    assert sorted(os.listdir(tmp_path)) == ["a"]


def test_part_files_are_named_so_the_proof_leaves_them_to_check_themselves():
    assert is_part_path(os.path.join("offload", "pp000_tp000_dp000.offload.parts", "step3-ab12cd34", "sg000001.state"))
    assert not is_part_path(os.path.join("offload", "pp000_tp000_dp000.offload"))
    assert not is_part_path("metadata.json")


@settings(max_examples=examples(20), deadline=None, derandomize=True, print_blob=True)
@given(tiers=st.sampled_from([["nvme"], ["host", "nvme"], ["host", "nvme", "pfs"], ["nvme", "pfs"]]),
       numel=st.integers(2_000, 30_000), subgroups=st.integers(6, 12),
       moments=st.sampled_from(["fp32", "bf16", "fp8"]), background=st.booleans(),
       load_tiers=st.sampled_from([["host"], ["nvme"], ["host", "nvme"]]), load_subgroup=st.integers(700, 12_000))
def test_save_then_load_round_trips_bit_identically(tiers, numel, subgroups, moments, background, load_tiers,
                                                     load_subgroup):
    dtypes, subgroup = ("fp32", moments, moments), -(-numel // subgroups)  # more than the pipeline buffers
    with tempfile.TemporaryDirectory() as root:
        path = os.path.join(root, "x.offload")
        options = dict(subgroup_size=subgroup, state_dtypes=dtypes)
        if "host" in tiers:
            options["host_budget_bytes"] = 2 * 3 * 4 * (subgroup + 2048)
        with OffloadedAdamW(torch.randn(numel), fast_config(Path(root) / "a", tiers=tiers, **options)) as eng:
            run_steps(eng, bf16_grads(1, 2, numel))
            expected = engine_state(eng)
            if background:
                write = start_background_save(eng, path, link_tier_files=True)
                write.start()
                run_steps(eng, bf16_grads(2, 1, numel))
                write.wait()
                assert write.failure is None
            else:
                save_engine_state(eng, path, link_tier_files=True)
        assert _parts(path)
        # 8-bit moments loaded at another subgroup size are quantized again (not a part file's doing)
        load = dict(subgroup_size=subgroup if moments == "fp8" else load_subgroup, state_dtypes=dtypes)
        with OffloadedAdamW(torch.zeros(numel), fast_config(Path(root) / "b", tiers=load_tiers, **load)) as eng:
            load_engine_state(eng, path)
            assert _equal(engine_state(eng), expected)


@settings(max_examples=examples(10), deadline=None, derandomize=True, print_blob=True)
@given(case=cases())
def test_the_digest_of_a_linked_save_is_the_one_its_load_computes(case):
    """The resume check: a save that links reads the linked files for its digest, a load of it agrees."""
    with tempfile.TemporaryDirectory() as root:
        path, recorded, params = save_with_digests(root, case, link=True)
        assert load_with_digests(root, case, path, params) == recorded


@pytest.mark.parametrize("moments,background", [("fp8", False), ("bf16", True)])
def test_a_linked_save_records_the_digest_a_load_computes(moments, background):
    case = fixed_case(tiers=["nvme"], numel=12_000, subgroup=1_500, moments=moments, background=background)
    with tempfile.TemporaryDirectory() as root:
        path, recorded, params = save_with_digests(root, case, link=True)
        assert _parts(path)
        assert load_with_digests(root, case, path, params) == recorded
