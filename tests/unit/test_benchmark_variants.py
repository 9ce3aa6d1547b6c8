"""The product variants the determinism experiment measures beside main's code in one call
(benchmarks/variants/*.patch, runs named like A8_<variant>) still apply to this tree: a stale one would fail on the
GPU machine, after its start-up, instead of here."""

import pathlib
import shutil
import subprocess

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
PATCHES = sorted((ROOT / "benchmarks" / "variants").glob("*.patch"))


@pytest.mark.skipif(shutil.which("git") is None or not (ROOT / ".git").exists(), reason="needs git and a checkout")
@pytest.mark.parametrize("patch", PATCHES, ids=[p.stem for p in PATCHES])
def test_a_variant_applies_to_this_tree(patch):
    done = subprocess.run(["git", "apply", "--check", str(patch)], cwd=ROOT, capture_output=True, text=True)
    assert done.returncode == 0, f"{patch.name} no longer applies: {done.stderr.strip()}"


def test_there_is_a_variant_to_check():
    assert PATCHES, "benchmarks/variants/ holds no patch"
