"""Hypothesis profiles, picked by MLP_OFFLOAD_TEST_PROFILE: ``ci`` (the default: tests/run.sh and CI)
or ``thorough``. A property test writes its thorough example count as ``examples(N)``: ``thorough``
draws N, ``ci`` a fifth of it (at least a few). Under ``ci`` every test's examples are derandomized
(a CI run repeats the last one); under ``thorough`` only those of tests that ask for it.
Launch-heavy parametrized cases (``cases``) are drawn by a seed, MLP_OFFLOAD_CASE_SEED, fresh each run
unless set; conftest prints it in the header, under every failure and in the summary."""

import os
import random
import secrets

from hypothesis import settings

PERCENT = {"ci": 20, "thorough": 100}  # of each test's written count; also of hypothesis' default 100
PROFILE = os.environ.get("MLP_OFFLOAD_TEST_PROFILE", "ci")
if PROFILE not in PERCENT:
    raise SystemExit(f"error: MLP_OFFLOAD_TEST_PROFILE={PROFILE!r}: expected one of {', '.join(PERCENT)}")
for _name, _percent in PERCENT.items():
    settings.register_profile(_name, max_examples=_percent, deadline=None, derandomize=_name == "ci", print_blob=True)
settings.load_profile(PROFILE)


def _case_seed() -> int:
    text = os.environ.get("MLP_OFFLOAD_CASE_SEED", "")
    if not text:
        return secrets.randbelow(10**6)  # each run another draw: over many runs CI goes through every case
    if not text.isdigit():
        raise SystemExit(f"error: MLP_OFFLOAD_CASE_SEED={text!r}: expected a non-negative integer")
    return int(text)


# Which launch-heavy cases ``ci`` runs; MLP_OFFLOAD_CASE_SEED=N reruns exactly the cases of a failed run.
CASE_SEED = _case_seed()
os.environ["MLP_OFFLOAD_CASE_SEED"] = str(CASE_SEED)  # processes the tests start draw the same cases
RERUN_CASES = f"MLP_OFFLOAD_CASE_SEED={CASE_SEED}"


def examples(thorough: int, floor: int = 5) -> int:
    """This profile's share of ``thorough`` examples, never below ``floor`` (or ``thorough`` if less)."""
    return max(min(thorough, floor), thorough * PERCENT[PROFILE] // 100)


def cases(all_cases, ci_keep: int):
    """Parametrized cases that each cost process launches: all under ``thorough``; under ``ci``,
    ``ci_keep`` of them drawn by ``CASE_SEED`` (the same seed, the same cases, in the same order),
    another draw each run unless the seed is set. The chosen ids show in the test names; the seed is
    printed under every failure, to rerun the same cases."""
    ordered = sorted(all_cases)
    if PROFILE == "thorough" or ci_keep >= len(ordered):
        return ordered
    return random.Random(CASE_SEED).sample(ordered, ci_keep)
