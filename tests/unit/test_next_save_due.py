"""--async-save's writers are to be done before the next save (megatron/training/checkpoint/async_save.py): when
that comes, from --save-interval, the end of training and the iterations' time the loop's polls saw."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from megatron.training.checkpoint import async_save
from megatron.training.checkpoint.async_save import BackgroundSaves, next_save_in_s


def test_the_next_save_is_the_next_interval_or_the_end_of_training_whichever_comes_first():
    assert next_save_in_s(100, [50], 1000, 2.0) == pytest.approx(100.0)  # at 150
    assert next_save_in_s(980, [50], 1000, 2.0) == pytest.approx(40.0)  # the end of training's, at 1000
    assert next_save_in_s(100, [None], 1000, 2.0) == pytest.approx(1800.0)  # no interval: only the end's
    assert next_save_in_s(100, [50], None, 2.0) == pytest.approx(100.0)  # trained by samples: the interval's
    assert next_save_in_s(1000, [50], 1000, 2.0) is None  # the last save: nothing after it
    assert next_save_in_s(100, [50], 1000, None) is None  # no iteration timed yet
    assert next_save_in_s(107, [50], 1000, 2.0) == pytest.approx(86.0)  # a save off the interval (a signal's): at 150


@settings(max_examples=200, deadline=None)
@given(iteration=st.integers(1, 500), persistent=st.one_of(st.none(), st.integers(1, 60)),
       non_persistent=st.one_of(st.none(), st.integers(1, 60)), train_iters=st.one_of(st.none(), st.integers(1, 600)))
def test_with_non_persistent_saves_the_next_save_is_the_nearest_of_either_kind(iteration, persistent, non_persistent,
                                                                               train_iters):
    """Against the loop's own rule, iteration by iteration: a save comes at a multiple of either interval or at the
    end of training."""
    due = None
    for later in range(iteration + 1, (train_iters or 10_000) + 1):
        if any(n and later % n == 0 for n in (persistent, non_persistent)) or later == train_iters:
            due = later
            break
    got = next_save_in_s(iteration, [persistent, non_persistent], train_iters, 1.0)
    assert got == (None if due is None else pytest.approx(due - iteration)), (due, got)


def test_the_iteration_time_is_the_shortest_recent_gap_between_polls(monkeypatch):
    now = [0.0]
    monkeypatch.setattr(async_save.time, "perf_counter", lambda: now[0])
    saves = BackgroundSaves(torch.device("cpu"))
    assert saves.iteration_s() is None
    for gap in (9.0, 3.0, 7.5, 3.5, 4.0):  # 7.5: an iteration with an evaluation or a save's hold in it
        now[0] += gap
        saves.poll()  # nothing pending: no collective
    assert saves.iteration_s() == pytest.approx(3.5)  # of the last POLLS_KEPT polls' gaps (7.5, 3.5, 4.0)


def test_a_save_with_no_tier_on_its_disk_leaves_no_report_file(tmp_path, monkeypatch):
    """torch_dist's flushes are paced only behind a file tier on the checkpoint's disk; elsewhere no report file
    is made for them (one was made and removed per save before)."""
    from types import SimpleNamespace

    monkeypatch.setattr(async_save.tempfile, "tempdir", str(tmp_path / "tmp"))
    (tmp_path / "tmp").mkdir()
    (tmp_path / "ckpt").mkdir()
    made = []
    real_mkstemp = async_save.tempfile.mkstemp
    monkeypatch.setattr(async_save.tempfile, "mkstemp", lambda **kw: made.append(kw) or real_mkstemp(**kw))
    shards = [SimpleNamespace(engine=SimpleNamespace(file_tiers={}))]  # no file tier at all
    assert async_save.torch_dist_flush(shards, str(tmp_path / "ckpt" / "iter_0000002"), 10.0) is None
    assert not made and not list((tmp_path / "tmp").iterdir())
