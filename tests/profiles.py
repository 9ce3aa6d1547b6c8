"""Hypothesis profiles, picked by MLP_OFFLOAD_TEST_PROFILE: ``ci`` (the default: tests/run.sh and CI)
or ``thorough``. A property test writes its thorough example count as ``examples(N)``: ``thorough``
draws N, ``ci`` a fifth of it (at least a few). Under ``ci`` every test's examples are derandomized
(a CI run repeats the last one); under ``thorough`` only those of tests that ask for it."""

import os

from hypothesis import settings

PERCENT = {"ci": 20, "thorough": 100}  # of each test's written count; also of hypothesis' default 100
PROFILE = os.environ.get("MLP_OFFLOAD_TEST_PROFILE", "ci")
if PROFILE not in PERCENT:
    raise SystemExit(f"error: MLP_OFFLOAD_TEST_PROFILE={PROFILE!r}: expected one of {', '.join(PERCENT)}")
for _name, _percent in PERCENT.items():
    settings.register_profile(_name, max_examples=_percent, deadline=None, derandomize=_name == "ci", print_blob=True)
settings.load_profile(PROFILE)


def examples(thorough: int, floor: int = 5) -> int:
    """This profile's share of ``thorough`` examples, never below ``floor`` (or ``thorough`` if less)."""
    return max(min(thorough, floor), thorough * PERCENT[PROFILE] // 100)
