"""--non-persistent-ckpt-type global (megatron.training.checkpoint.integrity and load_plan), on directories made in
the test: its directory keeps only its newest complete checkpoint, a resume takes the later of it and --load's
(against the rule written out here), a problem in it is said and passed over, and the flags are checked in one line."""

import argparse
import os

import pytest
from hypothesis import given, settings, strategies as st

from megatron.training.checkpoint import integrity
from megatron.training.checkpoint.load_plan import newer_checkpoint_root
from .helpers import MARKERS, TINY_ARGS, make_checkpoint_dir as make, parse_error


@settings(max_examples=60, deadline=None)
@given(st.dictionaries(st.integers(1, 60), st.sampled_from(MARKERS), max_size=12), st.integers(1, 70))
def test_the_non_persistent_directory_retires_every_earlier_complete_one(tmp_path_factory, saved, newest):
    root = tmp_path_factory.mktemp("np")
    for it, marker in saved.items():
        make(root, it, marker=marker)
    expected = sorted(it for it, marker in saved.items() if it < newest and marker == integrity.COMPLETE)
    assert [it for it, _ in integrity.to_retire(str(root), newest, integrity.NEWEST_ONLY)] == expected


def test_its_retirement_line_names_why(tmp_path):
    for it in (2, 4, 6):
        make(tmp_path, it, marker=integrity.COMPLETE)
    lines = []
    integrity.retire(str(tmp_path), 6, integrity.NEWEST_ONLY, say=lines.append).join()
    assert sorted(integrity.iteration_dirs(str(tmp_path))) == [6]
    assert lines[0].startswith("> retired the checkpoints at iterations 2, 4 (the non-persistent directory keeps its "
                               "newest; the one at 6 is complete)"), lines


def make_complete(root, iteration):
    """A checkpoint whose proof holds (choose_checkpoint verifies the newest one's COMPLETE.json)."""
    path = make(root, iteration, marker=integrity.IN_PROGRESS)
    integrity.mark_complete(path, iteration)
    return path


@settings(max_examples=40, deadline=None)
@given(persistent=st.sets(st.integers(1, 30), max_size=4), non_persistent=st.sets(st.integers(1, 30), max_size=4))
def test_a_resume_reads_the_later_of_the_two_and_load_on_a_tie(tmp_path_factory, persistent, non_persistent):
    load, np_root = tmp_path_factory.mktemp("load"), tmp_path_factory.mktemp("np")
    for it in persistent:
        make_complete(load, it)
    for it in non_persistent:
        make_complete(np_root, it)
    root, note = newer_checkpoint_root(str(load), str(np_root))
    later = non_persistent and (not persistent or max(non_persistent) > max(persistent))
    assert root == (str(np_root) if later else str(load))
    assert (note is not None) == bool(later)
    if later:
        assert note.startswith(f"resuming from the non-persistent checkpoint at iteration {max(non_persistent)} in "
                               f"{np_root}"), note


def test_a_load_directory_not_made_yet_gives_way_to_a_non_persistent_checkpoint(tmp_path):
    make_complete(tmp_path / "np", 4)
    root, note = newer_checkpoint_root(str(tmp_path / "ckpt"), str(tmp_path / "np"))
    assert root == str(tmp_path / "np") and note.endswith(f"(--load {tmp_path / 'ckpt'} holds none)")


def test_a_damaged_non_persistent_directory_is_said_and_passed_over(tmp_path):
    make_complete(tmp_path / "ckpt", 2)
    damaged = make_complete(tmp_path / "np", 4)
    with open(os.path.join(damaged, "offload", "state.offload"), "ab") as f:
        f.write(b"more")  # its size no longer the proof's
    root, note = newer_checkpoint_root(str(tmp_path / "ckpt"), str(tmp_path / "np"))
    assert root == str(tmp_path / "ckpt")
    assert note.startswith(f"--non-persistent-ckpt-type global: {tmp_path / 'np'} not used: "), note


def test_where_the_non_persistent_checkpoints_go():
    args = argparse.Namespace(non_persistent_ckpt_type="global", non_persistent_global_ckpt_dir=None)
    assert integrity.non_persistent_root(args, "/ckpt") == os.path.join("/ckpt", "non_persistent")
    args.non_persistent_global_ckpt_dir = "/scratch/np"
    assert integrity.non_persistent_root(args, "/ckpt") == "/scratch/np"
    args.non_persistent_ckpt_type = None
    assert integrity.non_persistent_root(args, "/ckpt") is None


@pytest.mark.parametrize("flags,message", [
    (["--non-persistent-ckpt-type", "local"], "argument --non-persistent-ckpt-type: local is Megatron-LM's, not "
     "built here; global (ordinary checkpoints in --non-persistent-global-ckpt-dir) is"),
    (["--non-persistent-ckpt-type", "in_memory"], "argument --non-persistent-ckpt-type: in_memory is Megatron-LM's, "
     "not built here; global (ordinary checkpoints in --non-persistent-global-ckpt-dir) is"),
    (["--save", "SAVE", "--non-persistent-save-interval", "5"],
     "argument --non-persistent-save-interval: requires --non-persistent-ckpt-type global"),
    (["--non-persistent-save-interval", "5", "--non-persistent-ckpt-type", "global"],
     "argument --non-persistent-save-interval: requires --save DIR"),
    (["--non-persistent-global-ckpt-dir", "NP"],
     "argument --non-persistent-global-ckpt-dir: requires --non-persistent-ckpt-type global"),
    (["--save", "SAVE", "--non-persistent-ckpt-type", "global", "--non-persistent-global-ckpt-dir", "SAVE"],
     "argument --non-persistent-global-ckpt-dir: SAVE is --save itself; it keeps only its newest checkpoint, so it "
     "needs a directory of its own"),
])
def test_the_flags_are_checked_in_one_line(tmp_path, flags, message):
    flags = [str(tmp_path / f) if f in ("SAVE", "NP") else f for f in flags]
    assert parse_error(flags) == message.replace("SAVE", str(tmp_path / "SAVE"))


def test_megatron_lms_flags_parse_as_its_scripts_give_them(tmp_path):
    from megatron.training.args.arguments import parse_args
    args = parse_args(["--mock-data", "--save", str(tmp_path), "--non-persistent-save-interval", "50",
                       "--non-persistent-ckpt-type", "global"] + TINY_ARGS)
    assert (args.non_persistent_save_interval, args.non_persistent_ckpt_type) == (50, "global")
    assert integrity.non_persistent_root(args, args.save) == os.path.join(str(tmp_path), "non_persistent")
