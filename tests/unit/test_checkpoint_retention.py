"""--save-retain-interval's retirement (megatron.training.checkpoint.integrity), on directories made in the test:
which checkpoints a complete one retires over the space of iterations and intervals (against the rule written out
here), that they vanish from listings at once and their files go on a thread, that hidden leftovers of an earlier
run go too, that links and later checkpoints stay, and that a refusal is one line, never an exception."""

import os

import pytest
from hypothesis import given, settings, strategies as st

from megatron.training.checkpoint import integrity, save_agreement
from .helpers import MARKERS, make_checkpoint_dir as make, parse_error


@settings(max_examples=60, deadline=None)
@given(st.dictionaries(st.integers(1, 60), st.sampled_from(MARKERS), max_size=12), st.integers(1, 12),
       st.integers(1, 70))
def test_a_checkpoint_retires_exactly_the_earlier_complete_ones_off_the_interval(tmp_path_factory, saved, interval,
                                                                                  newest):
    root = tmp_path_factory.mktemp("r")
    for it, marker in saved.items():
        make(root, it, marker=marker)
    expected = sorted(it for it, marker in saved.items()  # the rule, written out: incomplete and unproven ones stay
                      if it < newest and it % interval != 0 and marker == integrity.COMPLETE)
    assert [it for it, _ in integrity.to_retire(str(root), newest, interval)] == expected


def test_retired_checkpoints_vanish_at_once_and_their_bytes_are_told(tmp_path):
    for it in (2, 4, 6, 8, 10):
        make(tmp_path, it, nbytes=1_000_000)
    os.symlink(integrity.checkpoint_dir(str(tmp_path), 4), integrity.checkpoint_dir(str(tmp_path), 3))  # a pointer
    lines = []
    thread = integrity.retire(str(tmp_path), 8, 4, say=lines.append)
    assert sorted(integrity.iteration_dirs(str(tmp_path))) == [3, 4, 8, 10]  # hidden before the thread removes them
    thread.join()
    assert sorted(os.listdir(tmp_path)) == ["iter_0000003", "iter_0000004", "iter_0000008", "iter_0000010"]
    assert lines == [f"> retired the checkpoints at iterations 2, 6 (not multiples of --save-retain-interval 4; the "
                     f"one at 8 is complete): 2.00 MB removed from {tmp_path} in {lines[0].split(' in ')[-1]}"]


def test_a_hard_linked_file_frees_nothing_and_its_other_name_stays(tmp_path):
    tier = tmp_path / "tier.bin"
    tier.write_bytes(b"y" * 4_000_000)
    path = make(tmp_path / "ckpt", 2, nbytes=100_000)
    os.link(tier, os.path.join(path, "offload", "part.bin"))  # a tier file linked into the checkpoint
    make(tmp_path / "ckpt", 4)
    lines = []
    integrity.retire(str(tmp_path / "ckpt"), 4, 4, say=lines.append).join()
    assert "0.10 MB removed" in lines[0] and tier.read_bytes() == b"y" * 4_000_000


def test_leftovers_of_an_interrupted_retirement_go_with_the_next(tmp_path):
    left = tmp_path / f"{integrity.RETIRING}iter_0000002_999"
    (left / "offload").mkdir(parents=True)
    (left / "offload" / "f").write_bytes(b"z" * 500_000)
    make(tmp_path, 4)
    lines = []
    thread = integrity.retire(str(tmp_path), 4, 4, say=lines.append)  # nothing of its own to retire
    thread.join()
    assert not left.exists() and lines == [f"> removed 1 checkpoint(s) an earlier run had begun to retire: 0.50 MB "
                                           f"from {tmp_path}"]
    assert integrity.retire(str(tmp_path), 4, 4, say=lines.append) is None  # nothing left: no thread
    assert integrity.retire(str(tmp_path), 4, None, say=lines.append) is None  # the flag not given


def test_a_refused_rename_is_one_line_and_the_checkpoint_stays(tmp_path, monkeypatch):
    make(tmp_path, 2)
    make(tmp_path, 4)

    def refuse(src, dst):
        raise PermissionError(13, "Permission denied")
    monkeypatch.setattr(integrity.os, "rename", refuse)
    lines = []
    assert integrity.retire(str(tmp_path), 4, 4, say=lines.append) is None
    assert lines == [f"> --save-retain-interval: could not retire {integrity.checkpoint_dir(str(tmp_path), 2)}: "
                     f"Permission denied; it stays"]
    assert sorted(integrity.iteration_dirs(str(tmp_path))) == [2, 4]


def test_a_refused_removal_is_one_line_not_an_exception(tmp_path, monkeypatch):
    make(tmp_path, 2)
    make(tmp_path, 4)
    monkeypatch.setattr(integrity, "remove_tree", lambda path, failed: failed(path, OSError("Read-only file system")))
    lines = []
    integrity.retire(str(tmp_path), 4, 4, say=lines.append).join()
    assert lines[1].startswith("> --save-retain-interval: 1 file(s) could not be removed, e.g. ")
    assert lines[1].endswith(": Read-only file system") and len(lines) == 2


def test_the_runs_end_waits_for_its_removals(tmp_path, monkeypatch):
    import threading
    release = threading.Event()
    real = integrity.remove_tree
    monkeypatch.setattr(integrity, "remove_tree", lambda path, failed: (release.wait(5), real(path, failed)))
    make(tmp_path, 2)
    make(tmp_path, 4)
    lines = []
    thread = integrity.retire(str(tmp_path), 4, 4, say=lines.append)
    assert thread.is_alive()
    threading.Timer(0.2, release.set).start()
    integrity.finish_retiring(say=lines.append)
    assert not thread.is_alive() and lines[0].startswith("> waiting for the retired checkpoints' removal")
    assert os.listdir(tmp_path) == ["iter_0000004"]


@pytest.mark.parametrize("flags,message", [
    (["--save-retain-interval", "6", "--save-interval", "4"],
     "argument --save-retain-interval: 6 is not a multiple of --save-interval 4"),
    (["--save-retain-interval", "8"], "argument --save-retain-interval: requires --save DIR and --save-interval N"),
])
def test_the_flag_is_checked_in_one_line(tmp_path, flags, message):
    assert parse_error(["--save", str(tmp_path), *flags]) == message


def test_a_retirement_while_the_last_one_still_removes_leaves_its_directories_to_it(tmp_path, monkeypatch):
    import threading
    release = threading.Event()
    real = integrity.remove_tree
    monkeypatch.setattr(integrity, "remove_tree", lambda path, failed: (release.wait(5), real(path, failed)))
    for it in (2, 4, 6, 8):
        make(tmp_path, it)
    first, second = [], []
    slow = integrity.retire(str(tmp_path), 4, 4, say=first.append)  # 2, still being removed
    monkeypatch.setattr(integrity, "remove_tree", real)
    integrity.retire(str(tmp_path), 8, 4, say=second.append).join()  # 6; 2's hidden name is not a leftover
    release.set()
    slow.join()
    assert first[0].startswith("> retired the checkpoints at iterations 2 (") and len(first) == 1
    assert second[0].startswith("> retired the checkpoints at iterations 6 (") and len(second) == 1
    assert sorted(os.listdir(tmp_path)) == ["iter_0000004", "iter_0000008"]


@settings(max_examples=80, deadline=None)
@given(st.integers(0, 60), st.one_of(st.none(), st.integers(1, 12)), st.one_of(st.none(), st.integers(1, 80)),
       st.booleans())
def test_the_planned_saves_are_every_interval_and_the_end_of_training(iteration, interval, train_iters, at_end):
    later = save_agreement.planned_saves(iteration, interval, train_iters, at_end)
    if train_iters is None:
        assert later == []
    else:  # the loop's rule, written out: a multiple of the interval, or (at_end) the last iteration
        assert later == [i for i in range(iteration + 1, train_iters + 1)
                         if (interval and i % interval == 0) or (at_end and i == train_iters)]


@settings(max_examples=200, deadline=None)
@given(st.integers(1, 40), st.integers(1, 8), st.integers(0, 60), st.sampled_from(["all", "newest", "multiples"]),
       st.integers(1, 4), st.integers(1, 9), st.integers(0, 30))
def test_the_forecast_names_the_first_save_that_will_not_fit(first, interval, more, kept, retain_factor, size, free):
    saves = save_agreement.planned_saves(first * interval - 1, interval, first * interval + more)
    retain = {"all": None, "newest": integrity.NEWEST_ONLY, "multiples": retain_factor * interval}[kept]

    def on_disk_while_writing(j):  # the run's checkpoints there while saves[j] is written, counted directly
        if j == 0:
            return 0
        if retain is None:
            return j
        earlier_kept = [s for s in saves[:j - 1] if retain != integrity.NEWEST_ONLY and s % retain == 0]
        return len(earlier_kept) + 1  # those the retention keeps, and the newest (retired only once this one is done)

    expected = next((saves[j] for j in range(len(saves)) if size * (on_disk_while_writing(j) + 1) > free), None)
    assert save_agreement.first_refused_save(saves, retain, size, free) == expected
