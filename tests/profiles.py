"""Hypothesis profiles, picked by MLP_OFFLOAD_TEST_PROFILE: ``ci`` (the default: tests/run.sh and CI)
or ``thorough``. A property test writes its thorough example count as ``examples(N)``: ``thorough``
draws N, ``ci`` a fifth of it (at least a few). Under ``ci`` every test's examples are derandomized
(a CI run repeats the last one); under ``thorough`` only those of tests that ask for it."""

import datetime
import os

from hypothesis import settings

PERCENT = {"ci": 20, "thorough": 100}  # of each test's written count; also of hypothesis' default 100
PROFILE = os.environ.get("MLP_OFFLOAD_TEST_PROFILE", "ci")
if PROFILE not in PERCENT:
    raise SystemExit(f"error: MLP_OFFLOAD_TEST_PROFILE={PROFILE!r}: expected one of {', '.join(PERCENT)}")
for _name, _percent in PERCENT.items():
    settings.register_profile(_name, max_examples=_percent, deadline=None, derandomize=_name == "ci", print_blob=True)
settings.load_profile(PROFILE)
# Which window of launch-heavy cases ``ci`` runs: today's by default; the suite's header prints it, and
# MLP_OFFLOAD_CASE_DAY=N reruns exactly the cases of a failed run.
CASE_DAY = int(os.environ.get("MLP_OFFLOAD_CASE_DAY") or datetime.date.today().toordinal())


def examples(thorough: int, floor: int = 5) -> int:
    """This profile's share of ``thorough`` examples, never below ``floor`` (or ``thorough`` if less)."""
    return max(min(thorough, floor), thorough * PERCENT[PROFILE] // 100)


def cases(all_cases, ci_keep: int):
    """Parametrized cases that each cost process launches: all under ``thorough``; under ``ci``,
    ``ci_keep`` of them, a different window each day (the window moves by ``ci_keep`` a day), so
    consecutive days' CI runs go through every case. The chosen ids show in the test names; the day
    (``CASE_DAY``) is in the suite's header, to rerun a failed window."""
    ordered = sorted(all_cases)
    if PROFILE == "thorough" or ci_keep >= len(ordered):
        return ordered
    start = (CASE_DAY * ci_keep) % len(ordered)
    return [ordered[(start + k) % len(ordered)] for k in range(ci_keep)]
