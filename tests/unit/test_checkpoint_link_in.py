"""Loads that take a checkpoint's part files into the engine's file tiers by hard link (``checkpoint.link_in``):
the tier file is the part's inode, the loaded state is the saved one bit for bit, training after it never
changes the checkpoint's bytes and matches a load by copying, other layouts load by reading, damage is found,
and deleting the checkpoint does not touch training."""

import errno
import hashlib
import logging
import os
import shutil
import tempfile
import threading
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings, strategies as st

from mlp_offload import OffloadedAdamW, OffloadStateError
from mlp_offload.checkpoint import CheckpointDataError, StateFile, fill_engine, load_engine_state, read_footer
from mlp_offload.checkpoint.digest import StateDigest
from mlp_offload.checkpoint.parts import PartSources
from mlp_offload.checkpoint.write import save_engine_state
from mlp_offload.pipeline import SlotPipeline
from tests.profiles import examples

from .helpers import bf16_grads, engine_state, fast_config, run_steps
from .test_state_digest import fixed_case, load_with_digests, save_with_digests

NUMEL = 60_001


def config(root, tiers=("nvme",), **options):
    options.setdefault("subgroup_size", 8_000)
    return fast_config(Path(root), tiers=list(tiers), **options)


def saved_engine(root, path, tiers=("nvme",), steps=2, **options):
    """The state an engine held when it saved ``path`` (linking its tier files in), after ``steps`` steps."""
    with OffloadedAdamW(torch.randn(NUMEL, generator=torch.Generator().manual_seed(3)),
                        config(root, tiers, **options)) as eng:
        run_steps(eng, bf16_grads(0, steps, NUMEL))
        save_engine_state(eng, path, link_tier_files=True)
        return engine_state(eng)


def part_files(path):
    base = os.path.dirname(path)
    return [os.path.join(base, e["part"]["file"]) for e in read_footer(path)["subgroups"] if "part" in e]


def tier_files(root):
    """File name -> path of the subgroup files under ``root`` (a tier's)."""
    return {n: os.path.join(d, n) for d, _, names in os.walk(root) for n in names if n.endswith(".state")}


def hashes(paths):
    return {p: hashlib.sha256(open(p, "rb").read()).hexdigest() for p in paths}


def equal(a, b):
    return all(torch.equal(x, y) for x, y in zip(a, b))


def linked_in(parts, root):
    """The part files that are a tier file under ``root`` too (same inode)."""
    tier = {os.stat(p).st_ino for p in tier_files(root).values()}
    return [p for p in parts if os.stat(p).st_ino in tier]


def test_a_load_at_the_saved_layout_links_the_parts_in_and_training_leaves_them(tmp_path, monkeypatch):
    path = str(tmp_path / "ckpt" / "x.offload")
    os.makedirs(os.path.dirname(path))
    expected = saved_engine(tmp_path / "a", path)
    parts = part_files(path)
    assert parts and all(os.stat(p).st_nlink == 1 for p in parts)  # the saving run's tiers are gone
    before = hashes(parts)
    shutil.copytree(tmp_path / "ckpt", tmp_path / "copy")
    grads = bf16_grads(5, 3, NUMEL)
    read = []
    plain_read = PartSources.read
    monkeypatch.setattr(PartSources, "read", lambda self, e, *a: read.append(e["start"]) or plain_read(self, e, *a))
    with OffloadedAdamW(torch.zeros(NUMEL), config(tmp_path / "b")) as eng:
        load_engine_state(eng, path)
        assert not read  # neither read for the fill nor by the read ahead
        monkeypatch.undo()
        assert sorted(linked_in(parts, tmp_path / "b")) == sorted(parts)
        assert all(os.stat(p).st_nlink == 2 for p in parts)
        assert equal(engine_state(eng), expected)
        run_steps(eng, grads)
        assert hashes(parts) == before  # the updates wrote new files, not into the checkpoint's
        after = engine_state(eng)
    with OffloadedAdamW(torch.zeros(NUMEL), config(tmp_path / "c")) as eng:
        load_engine_state(eng, str(tmp_path / "copy" / "x.offload"), link_parts=False)
        assert not linked_in(part_files(str(tmp_path / "copy" / "x.offload")), tmp_path / "c")
        assert equal(engine_state(eng), expected)
        run_steps(eng, grads)
        assert equal(engine_state(eng), after)
    assert hashes(parts) == before and all(os.stat(p).st_nlink == 1 for p in parts)


@pytest.mark.parametrize("load", [dict(subgroup_size=9_000), dict(tiers=("host",)),
                                  dict(io_block_bytes=32 * 1024)])
def test_another_layout_loads_by_reading(tmp_path, load):
    path = str(tmp_path / "x.offload")
    expected = saved_engine(tmp_path / "a", path)
    parts = part_files(path)
    before = hashes(parts)
    with OffloadedAdamW(torch.zeros(NUMEL), config(tmp_path / "b", **load)) as eng:
        load_engine_state(eng, path)
        assert not linked_in(parts, tmp_path / "b")
        assert equal(engine_state(eng), expected)
        run_steps(eng, bf16_grads(5, 2, NUMEL))
    assert hashes(parts) == before


def test_a_refused_link_loads_by_reading(tmp_path, monkeypatch):
    path = str(tmp_path / "x.offload")
    expected = saved_engine(tmp_path / "a", path)

    def refuse(*a, **k):
        raise OSError(errno.EXDEV, "Invalid cross-device link")
    with OffloadedAdamW(torch.zeros(NUMEL), config(tmp_path / "b")) as eng:
        monkeypatch.setattr(os, "link", refuse)
        load_engine_state(eng, path)
        monkeypatch.undo()
        assert not linked_in(part_files(path), tmp_path / "b")
        assert equal(engine_state(eng), expected)


def test_a_damaged_part_is_found_when_it_is_read(tmp_path):
    path = str(tmp_path / "x.offload")
    saved_engine(tmp_path / "a", path)
    part = part_files(path)[1]
    with open(part, "r+b") as f:
        f.seek(4_321)
        byte = f.read(1)
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([byte[0] ^ 0x04]))
    with OffloadedAdamW(torch.zeros(NUMEL), config(tmp_path / "b")) as eng:
        load_engine_state(eng, path)  # linked in, not read: the tier's first read checks it
        with pytest.raises((OffloadStateError, RuntimeError), match="checksum mismatch"):
            engine_state(eng)
    with OffloadedAdamW(torch.zeros(NUMEL), config(tmp_path / "c")) as eng, \
            pytest.raises(CheckpointDataError, match=f"{part}: checksum mismatch"):
        load_engine_state(eng, path, link_parts=False)
    with OffloadedAdamW(torch.zeros(NUMEL), config(tmp_path / "d")) as eng, StateFile(path) as saved:
        observed = StateDigest.of_engine(eng, [("p", 0, NUMEL, 0)])
        with pytest.raises((OffloadStateError, RuntimeError), match="checksum mismatch"):
            fill_engine(eng, saved, observe=observed.observing)  # the resume check reads it at the load


def test_deleting_the_checkpoint_after_a_linked_load_leaves_training_exact(tmp_path):
    path = str(tmp_path / "ckpt" / "x.offload")
    os.makedirs(os.path.dirname(path))
    saved_engine(tmp_path / "a", path)
    shutil.copytree(tmp_path / "ckpt", tmp_path / "copy")
    grads = bf16_grads(7, 3, NUMEL)
    with OffloadedAdamW(torch.zeros(NUMEL), config(tmp_path / "b")) as eng:
        load_engine_state(eng, str(tmp_path / "copy" / "x.offload"), link_parts=False)
        run_steps(eng, grads)
        expected = engine_state(eng)
    with OffloadedAdamW(torch.zeros(NUMEL), config(tmp_path / "c")) as eng:
        load_engine_state(eng, path)
        assert linked_in(part_files(path), tmp_path / "c")
        shutil.rmtree(tmp_path / "ckpt")
        run_steps(eng, grads[:1])
        save_engine_state(eng, str(tmp_path / "y.offload"), link_tier_files=True)  # a later save links again
        run_steps(eng, grads[1:])
        assert equal(engine_state(eng), expected)


@pytest.mark.parametrize("moments,remainders", [("fp8", False), ("bf16", True), ("fp32", False)])
def test_a_linked_load_computes_the_digest_the_save_recorded(moments, remainders, caplog):
    case = fixed_case(tiers=["nvme"], numel=12_000, subgroup=1_500, load_subgroup=1_500, moments=moments,
                      remainders=remainders, segments=[(0, 0, 12_000)])
    with tempfile.TemporaryDirectory() as root:
        path, recorded, params = save_with_digests(root, case, link=True)
        before = hashes(part_files(path))
        with caplog.at_level(logging.INFO, logger="mlp_offload"):
            assert load_with_digests(root, case, path, params) == recorded
        assert before and hashes(part_files(path)) == before
    said = [r.getMessage() for r in caplog.records if "linked into the tiers' files" in r.getMessage()]
    assert len(said) == 1 and ": 0.00 MB linked" not in said[0]


@settings(max_examples=examples(8), deadline=None, derandomize=True, print_blob=True)
@given(tiers=st.sampled_from([["nvme"], ["nvme", "pfs"], ["host", "nvme"]]),
       moments=st.sampled_from(["fp32", "bf16", "fp8"]), blocks=st.integers(50, 300), subgroups=st.integers(5, 10))
def test_linked_and_copied_loads_train_alike(tiers, moments, blocks, subgroups):
    # whole 64-element blocks: no padding between 8-bit codes and scales, whose bytes a load leaves as they were
    numel = 64 * blocks
    options = dict(subgroup_size=64 * -(-blocks // subgroups), state_dtypes=("fp32", moments, moments))
    if "host" in tiers:
        options["host_budget_bytes"] = 2 * 3 * 4 * (options["subgroup_size"] + 2048)
    with tempfile.TemporaryDirectory() as root:
        root = Path(root)
        path = str(root / "ckpt" / "x.offload")
        os.makedirs(os.path.dirname(path))
        with OffloadedAdamW(torch.randn(numel), config(root / "a", tiers, **options)) as eng:
            run_steps(eng, bf16_grads(1, 2, numel))
            save_engine_state(eng, path, link_tier_files=True)
            expected = engine_state(eng)
        shutil.copytree(root / "ckpt", root / "copy")
        before = hashes(part_files(path))
        grads = bf16_grads(4, 2, numel)
        states = []
        for name, source, link in (("b", path, True), ("c", str(root / "copy" / "x.offload"), False)):
            with OffloadedAdamW(torch.zeros(numel), config(root / name, tiers, **options)) as eng:
                load_engine_state(eng, source, link_parts=link)
                assert bool(linked_in(part_files(source), root / name)) == link
                assert equal(engine_state(eng), expected)
                run_steps(eng, grads)
                states.append(engine_state(eng))
        assert equal(*states)
        assert hashes(part_files(path)) == before


def test_a_loads_reads_of_linked_subgroups_run_beside_its_other_fills(tmp_path, monkeypatch):
    """With the resume check, the subgroups linked in are read for their digest on a thread of their own:
    here the first such read waits until a subgroup after it has been filled from the checkpoint, which
    a load that read them in turn with the others would never reach (it fails on the wait's timeout)."""
    path = str(tmp_path / "x.offload")
    expected = saved_engine(tmp_path / "a", path, steps=1)  # the step's last subgroups stay in its cache: copied
    linked = [k for k, e in enumerate(read_footer(path)["subgroups"]) if "part" in e]
    copied = [k for k, e in enumerate(read_footer(path)["subgroups"]) if "part" not in e]
    assert linked and copied and min(linked) < max(copied)  # a fill comes after the first linked read
    first, filled_after = min(linked), threading.Event()
    fill_from_tier = SlotPipeline.fill_from_tier

    def slow_first_read(pipeline, i, views):
        if i == first:
            assert filled_after.wait(timeout=20), "the linked subgroup's read held the other fills back"
        fill_from_tier(pipeline, i, views)

    with OffloadedAdamW(torch.zeros(NUMEL), config(tmp_path / "b")) as eng, StateFile(path) as saved:
        observed = StateDigest.of_engine(eng, [("p", 0, NUMEL, 0)])

        def observe(fill):
            def filled(sg, *tensors):
                observed.observing(fill)(sg, *tensors)
                if sg.start > eng.subgroups[first].start:
                    filled_after.set()
            return filled

        monkeypatch.setattr(SlotPipeline, "fill_from_tier", slow_first_read)
        fill_engine(eng, saved, observe=observe)
        monkeypatch.undo()
        # before the engine's buffers are used again (as the resume check takes it): its digest thread may still
        # be reading them, and engine_state streams the state through the same scratch buffer
        beside = observed.result()
        assert equal(engine_state(eng), expected)
    with OffloadedAdamW(torch.zeros(NUMEL), config(tmp_path / "c")) as eng, StateFile(path) as saved:
        read_in_turn = StateDigest.of_engine(eng, [("p", 0, NUMEL, 0)])
        fill_engine(eng, saved, observe=read_in_turn.observing, link_parts=False)  # every subgroup read
        assert beside == read_in_turn.result()
