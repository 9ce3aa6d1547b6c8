"""An unknown flag stops in one line that says what it most likely is: a near miss of a flag the parser takes, or
Megatron-LM's flag that this fork does not build (megatron_lm_flags.txt, written by tools/gen_upstream_flags.py from
Megatron-LM's source, which the test reads back on text made here); docs/flags.md files under Megatron-LM's flags
only theirs."""

import re
from pathlib import Path

import pytest

from megatron.training.args.arguments import parse_args
from megatron.training.args.unknown_flags import megatron_lm_flags, unknown_arguments_line
from megatron.training.errors import UserError

REPO = Path(__file__).resolve().parents[2]
TINY = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "64",
        "--max-position-embeddings", "64", "--micro-batch-size", "1", "--global-batch-size", "1", "--train-iters", "2",
        "--lr", "1e-4", "--mock-data"]


@pytest.mark.parametrize("given,line", [
    (["--save", "/tmp/x", "--save-intreval", "4"],
     "unrecognized arguments: --save-intreval 4 (--save-intreval: did you mean --save-interval?; docs/flags.md lists "
     "the flags taken)"),
    (["--ddp-bucket-size=100", "--frobnicate"],
     "unrecognized arguments: --ddp-bucket-size=100 --frobnicate (--ddp-bucket-size: Megatron-LM's, not built here; "
     "docs/flags.md lists the flags taken)"),
    (["--frobnicate", "7"], "unrecognized arguments: --frobnicate 7"),
    (["--offload-tier", "host"],
     "unrecognized arguments: --offload-tier host (--offload-tier: did you mean --offload-tiers?; docs/flags.md "
     "lists the flags taken)"),
])
def test_an_unknown_flag_is_one_line_saying_what_it_likely_is(given, line):
    with pytest.raises(UserError) as raised:
        parse_args(TINY + given)
    assert str(raised.value) == line


def test_a_note_needs_a_flag_not_a_value():
    assert unknown_arguments_line(["-1", "x"], ["--lr"]) == "unrecognized arguments: -1 x"


def _tool(name):
    import importlib.util
    spec = importlib.util.spec_from_file_location(name, REPO / "tools" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_generator_takes_add_argument_names_alone():
    source = '''
parser.add_argument("--kept", "-k", type=int)
group.add_argument('--also-kept', action="store_true", help="--not-a-flag here")
print("--not-either")
def f(g):
    g.add_argument("--inside-a-function")
'''
    gen = _tool("gen_upstream_flags")
    assert gen.declared_flags(source) == {"--kept", "--also-kept", "--inside-a-function"}
    text = gen.render(["a tag a/path.py"], {"--b", "--a"})
    assert text == "# Option names declared by Megatron-LM's argument parsers (tools/gen_upstream_flags.py), from:\n" \
                   "#   a tag a/path.py\n--a\n--b\n"


# Megatron-LM flags its config dataclasses derive (ArgumentGroupFactory, TrainingConfig at d98e8a64dd), which no
# literal add_argument names.
DERIVED = {"--exit-signal", "--step-batch-size-schedule"}


def test_the_flags_filed_as_megatron_lms_are_theirs():
    text = (REPO / "docs" / "flags.md").read_text()
    theirs = text[text.index("## Megatron-LM's flags accepted here"):]
    filed = set(re.findall(r"^\| `(--[a-z0-9-]+)`", theirs, re.M))
    assert len(filed) > 200 and filed - megatron_lm_flags() - DERIVED == set()
    assert "--ddp-bucket-size" in megatron_lm_flags() and "--offload-tiers" not in megatron_lm_flags()
