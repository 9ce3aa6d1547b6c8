"""docs/flags.md is tools/gen_flag_reference.py's output for today's parser: every flag once, its
default as parse_args fills it, and a stale file fails here with the command that regenerates it. Every
flag of pretrain_gpt.py and of tools/plan_offload.py has help text."""

import importlib.util
import re
from pathlib import Path

import pytest

from megatron.training.args.arguments import build_parser, declared_actions, declared_groups, is_help, parse_args

REPO = Path(__file__).resolve().parents[2]


def _tool(name):
    spec = importlib.util.spec_from_file_location(name, REPO / "tools" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


gen = _tool("gen_flag_reference")

BASE = ["--num-layers", "2", "--hidden-size", "8", "--num-attention-heads", "2", "--seq-length", "8",
        "--micro-batch-size", "1", "--train-iters", "2", "--lr", "1e-3", "--mock-data", "--device", "cpu"]
_CELL = re.compile(r"(?<!\\)\|")  # a table cell's edge: a pipe not escaped


@pytest.fixture(scope="module")
def rendered():
    return gen.render(build_parser())


def _rows(text):
    """{option string: [value, default, help]} from the reference's tables."""
    rows = {}
    for line in text.splitlines():
        if line.startswith("| `"):
            cells = [c.strip() for c in _CELL.split(line)[1:-1]]
            assert len(cells) == 4, line  # a pipe inside a help text would break the table
            for flag in re.findall(r"`(--[^`]+)`", cells[0]):
                assert flag not in rows, f"{flag} listed twice"
                rows[flag] = cells[1:]
    return rows


def test_the_committed_reference_is_todays_parser(rendered):
    committed = gen.REFERENCE.read_text()
    assert committed == rendered, f"docs/flags.md is stale: regenerate it with `{gen.REGENERATE}` and commit it"


def test_every_flag_of_the_parser_is_listed_once(rendered):
    rows = _rows(rendered)
    parser = build_parser()
    flags = {s for a in declared_actions(parser) if not is_help(a) for s in a.option_strings}
    assert set(rows) == flags, sorted(set(rows) ^ flags)
    assert "--offload-NAME-path" in flags  # the parser documents the form; parse_args takes the real flags
    args = parse_args(BASE + ["--offload-tiers", "host,burst", "--offload-burst-path", "/tmp/x",
                       "--offload-host-cache-gb", "1"])
    assert args.offload_paths == {"burst": "/tmp/x"}  # the path row's claim: any tier name works


def _flags_without_help(parser):
    return [a.option_strings[0] for a in declared_actions(parser) if a.option_strings and not (a.help or "").strip()]


def test_every_flag_of_pretrain_gpt_and_of_the_planner_has_help():
    assert _flags_without_help(build_parser()) == []
    assert _flags_without_help(_tool("plan_offload").machine_parser()) == []


def test_a_flag_without_help_is_caught():
    parser = build_parser()
    group = declared_groups(parser)[-1][0]
    group.add_argument("--bare-knob", type=int, default=1)
    group.add_argument("--blank-knob", type=int, default=1, help=" ")
    assert _flags_without_help(parser) == ["--bare-knob", "--blank-knob"]


def test_offload_defaults_are_what_parse_args_gives(rendered):
    """The documented defaults of the offload flags, against a parsed command that leaves them out."""
    rows = _rows(rendered)
    args = parse_args(BASE + ["--offload-tiers", "host"])
    parser = build_parser()
    checked = 0
    for action in declared_actions(parser):
        flag = action.option_strings[0] if action.option_strings else ""
        if not flag.startswith("--offload-") or action.nargs == 0:
            continue
        default = rows[flag][1]
        if default.startswith("`"):
            assert default == f"`{getattr(args, action.dest)}`", flag
            checked += 1
        else:  # none given: chosen at start-up (or after parsing), as its help says
            assert default == "–" and action.default in (None, {}), flag
    assert checked >= 5
    switches = [a.option_strings[0] for a in declared_actions(parser) if a.option_strings[0].startswith("--offload-no-")]
    assert switches and all(rows[s][:2] == ["switch", "off"] for s in switches)


def test_a_new_flag_makes_the_check_fail_and_names_the_command(tmp_path, monkeypatch, capsys):
    reference = tmp_path / "flags.md"
    monkeypatch.setattr(gen, "REFERENCE", reference)
    parser = build_parser()
    monkeypatch.setattr(gen, "build_parser", lambda: parser)
    reference.write_text(gen.render(parser))
    assert gen.main(["--check"]) == 0
    group = next(g for g, acts in declared_groups(parser) if any(s.startswith("--offload-tiers") for a in acts
                                                                 for s in a.option_strings))
    group.add_argument("--offload-new-knob", type=float, default=2.5, help="a knob with a | in its help; 50%%")
    assert gen.main(["--check"]) == 1
    assert gen.REGENERATE in capsys.readouterr().err
    row = _rows(gen.render(parser))["--offload-new-knob"]
    assert row == ["number", "`2.5`", "a knob with a \\| in its help; 50%"]
    assert gen.main([]) == 0 and gen.main(["--check"]) == 0
