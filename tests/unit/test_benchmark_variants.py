"""The product variants the determinism experiment measures beside main's code in one call
(benchmarks/variants/*.patch, runs named like A8_<variant>) still apply to this tree, and its flags variants
(benchmarks/variants/*.flags) name flags the parser knows: a stale one would fail on the GPU machine, after its
start-up, instead of here."""

import pathlib
import shutil
import subprocess

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
PATCHES = sorted((ROOT / "benchmarks" / "variants").glob("*.patch"))
FLAGS = sorted((ROOT / "benchmarks" / "variants").glob("*.flags"))


@pytest.mark.skipif(shutil.which("git") is None or not (ROOT / ".git").exists(), reason="needs git and a checkout")
@pytest.mark.parametrize("patch", PATCHES, ids=[p.stem for p in PATCHES])
def test_a_variant_applies_to_this_tree(patch):
    done = subprocess.run(["git", "apply", "--check", str(patch)], cwd=ROOT, capture_output=True, text=True)
    assert done.returncode == 0, f"{patch.name} no longer applies: {done.stderr.strip()}"


def test_there_is_a_variant_to_check():
    assert PATCHES, "benchmarks/variants/ holds no patch"


@pytest.mark.parametrize("flags", FLAGS, ids=[f.stem for f in FLAGS])
def test_a_flags_variant_names_flags_the_parser_knows(flags):
    from megatron.training.args.arguments import build_parser, declared_actions
    known = {option for action in declared_actions(build_parser()) for option in action.option_strings}
    named = [word for word in flags.read_text().split() if word.startswith("--")]
    assert named and set(named) <= known, f"{flags.name}: {sorted(set(named) - known)} not flags of pretrain_gpt.py"
