"""The launch-heavy cases under ``ci``: drawn by the seed alone, so a printed seed reruns them."""

import pytest

from tests import profiles

CASES = [f"case{k}" for k in range(8)]


def _drawn(monkeypatch, seed, profile="ci", keep=4):
    monkeypatch.setattr(profiles, "CASE_SEED", seed)
    monkeypatch.setattr(profiles, "PROFILE", profile)
    return profiles.cases(CASES, ci_keep=keep)


@pytest.mark.parametrize("seed", [0, 1, 907429])
def test_a_seed_draws_the_same_distinct_cases_every_time(monkeypatch, seed):
    first = _drawn(monkeypatch, seed)
    assert _drawn(monkeypatch, seed) == first
    assert len(set(first)) == 4 and set(first) <= set(CASES)


def test_seeds_reach_every_case_and_thorough_runs_all(monkeypatch):
    assert {case for seed in range(20) for case in _drawn(monkeypatch, seed)} == set(CASES)
    assert len({tuple(_drawn(monkeypatch, seed)) for seed in range(20)}) > 1
    assert _drawn(monkeypatch, 3, profile="thorough") == sorted(CASES)
    assert _drawn(monkeypatch, 3, keep=8) == sorted(CASES)
