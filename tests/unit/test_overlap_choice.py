"""OverlapChoice: the overlap is kept only where the steps measured it faster than the update in series."""

import pytest
from hypothesis import given, settings, strategies as st

from megatron.training.offload.overlap_choice import OverlapChoice


def _run(choice, settled_and_seconds):
    """Steps at the given intervals; each entry: (the step before settled?, the iteration's seconds)."""
    now, lines = 0.0, []
    for settled, seconds in settled_and_seconds:
        choice.step_ended(settled)
        now += seconds
        lines.append(choice.step_started(now))
    return [line for line in lines if line]


def test_the_60_b_case_turns_the_overlap_off_with_one_line():
    # settled steps (the first interval also moved state into the gpu tier: not counted), then overlapped ones
    choice = OverlapChoice()
    choice.step_started(0.0)
    lines = _run(choice, [(True, 17.8), (True, 5.40), (True, 5.35), (False, 6.07), (False, 6.10), (False, 6.05)])
    assert len(lines) == 1 and "overlapped iterations took 6.070 s, in series 5.350 s" in lines[0]
    assert not choice.overlap_on


def test_the_20_b_case_keeps_it():
    choice = OverlapChoice()
    choice.step_started(0.0)
    assert _run(choice, [(True, 9.27), (True, 2.77), (True, 2.22), (False, 2.10), (False, 2.13), (False, 2.12)]) == []
    assert choice.overlap_on


def test_skipped_steps_time_neither_way():
    choice = OverlapChoice()
    choice.step_started(0.0)
    # a skipped step's next iteration ran no update at all: it must not pass for a fast serial one
    _run(choice, [(True, 9.0), (None, 0.5), (True, 2.2), (True, 2.2), (False, 2.1), (False, 2.1)])
    assert choice.serial == pytest.approx([2.2, 2.2]) and choice.overlap_on


@settings(max_examples=60, deadline=None, derandomize=True)
@given(serial=st.lists(st.floats(0.1, 10), min_size=2, max_size=4),
       overlapped=st.lists(st.floats(0.1, 10), min_size=2, max_size=4))
def test_off_exactly_when_the_fastest_overlapped_iteration_is_slower_beyond_the_slack(serial, overlapped):
    choice = OverlapChoice()
    choice.step_started(0.0)
    lines = _run(choice, [(True, 1.0)] + [(True, s) for s in serial] + [(False, s) for s in overlapped])
    # decided once both ways have two figures: the first two overlapped iterations against every serial one
    slower = min(overlapped[:2]) > min(serial) * 1.02
    assert (len(lines) == 1) == slower and choice.overlap_on == (not slower)
