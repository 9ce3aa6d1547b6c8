"""Write docs/flags.md, the flag reference, from pretrain_gpt.py's own argparse parser.

    python tools/gen_flag_reference.py            # rewrite docs/flags.md
    python tools/gen_flag_reference.py --check    # exit 1 if docs/flags.md differs from the parser

Every flag comes from the parser's actions (option strings, type or choices, default, help), so the
reference follows any change to the flags without edits here; tests/unit/test_flag_reference.py
fails when the committed file is stale.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

REFERENCE = REPO / "docs" / "flags.md"
REGENERATE = "python tools/gen_flag_reference.py"

# Flags this stack adds that are neither an offload flag nor Megatron-LM's. A name here that the
# parser no longer has stops the generator, so the list cannot silently go stale.
ADDED_FLAGS = ("--device", "--loss-log", "--timing-log", "--ckpt-convert-memory-mb", "--no-use-distributed-optimizer",
               "--no-store-param-remainders", "--no-resume-check", "--no-ckpt-read-ahead", "--profile-dir")

_VALUE_TYPES = {  # megatron/training/errors.py's value types, as a reader would say them
    "positive_int": "int > 0", "non_negative_int": "int >= 0", "positive_float": "number > 0",
    "non_negative_float": "number >= 0", "finite": "number", "fraction": "number in [0, 1]",
    "int": "int", "float": "number", "str": "text",
}


def _arguments():
    """megatron/training/args/arguments.py: pretrain_gpt.py's parser and the view of its options."""
    try:
        from megatron.training.args import arguments
    except ModuleNotFoundError as err:
        raise SystemExit(f"error: tools/gen_flag_reference.py: {err}; run it in the project's environment "
                         "(source tools/setup_env.sh)") from None
    return arguments


def build_parser() -> argparse.ArgumentParser:
    """pretrain_gpt.py's parser (parse_args builds the same one before parsing)."""
    return _arguments().build_parser()


def _is_offload(action) -> bool:
    return any(s.startswith("--offload-") for s in action.option_strings)


def _value(action) -> str:
    if action.nargs == 0:  # store_true, store_false, store_const
        return "switch"
    if action.choices is not None:
        return " | ".join(str(c) for c in action.choices)
    if action.metavar:
        kind = str(action.metavar)
    elif action.type is None:
        kind = "text"
    else:
        name = getattr(action.type, "__name__", str(action.type))
        kind = _VALUE_TYPES.get(name, name.strip("_").replace("_", " "))
    if action.nargs in ("+", "*"):
        return f"one or more: {kind}"
    return kind


def _default(action) -> str:
    if action.required:
        return "required"
    if action.nargs == 0:  # a switch does its thing only where given
        return "off"
    if action.default is None or action.default in ({}, [], ()):
        return "–"
    return f"`{action.default}`"


def _help(parser, action) -> str:
    text = action.help or ""
    if "%" in text:  # argparse's own expansion: %(default)s, and %% for a percent sign
        params = dict(vars(action), prog=parser.prog)
        text = text % params
    return " ".join(text.split()) or "–"


def _cell(text: str) -> str:
    return text.replace("|", "\\|")


def _row(parser, action) -> str:
    flags = ", ".join(f"`{s}`" for s in action.option_strings)
    return f"| {flags} | {_cell(_value(action))} | {_default(action)} | {_cell(_help(parser, action))} |"


def _table(rows) -> list:
    return ["| flag | value | default | what it does |", "| --- | --- | --- | --- |", *rows, ""]


def _visible(actions) -> list:
    is_help = _arguments().is_help
    return [a for a in actions if a.help != argparse.SUPPRESS and a.option_strings and not is_help(a)]


def render(parser=None) -> str:
    parser = parser or build_parser()
    actions = {s: a for a in _arguments().declared_actions(parser) for s in a.option_strings}
    missing = [flag for flag in ADDED_FLAGS if flag not in actions]
    if missing:
        raise SystemExit(f"error: tools/gen_flag_reference.py: ADDED_FLAGS names {', '.join(missing)}, "
                         "which pretrain_gpt.py's parser no longer has; update the list")
    groups = [(g.title, _visible(acts)) for g, acts in _arguments().declared_groups(parser)]
    offload_groups = [(title, acts) for title, acts in groups if any(_is_offload(a) for a in acts)]
    added = [actions[f] for f in ADDED_FLAGS]
    listed = {id(a) for _, acts in offload_groups for a in acts} | {id(a) for a in added}

    out = ["# Flag reference", "",
           f"Generated from `pretrain_gpt.py`'s parser by `{REGENERATE}`; do not edit by hand",
           "(`tests/unit/test_flag_reference.py` fails when this file is stale). `python pretrain_gpt.py --help`",
           "prints the same help. \"–\" as a default: none, or chosen at start-up as the help says.",
           "`tools/plan_offload.py` takes the model, parallelism and offload flags below as well.", ""]
    out += ["## Offload flags (this repository's engine)", ""]
    for title, acts in offload_groups:
        out += [f"### {title}", ""]
        out += _table([_row(parser, a) for a in acts])
    out += ["## Other flags this stack adds", ""]
    out += _table([_row(parser, a) for a in added])
    out += ["## Megatron-LM's flags accepted here",
            "",
            "Megatron-LM's meaning and defaults unless the help says otherwise; what differs is in",
            "[user_guide.md](user_guide.md#coming-from-megatron-lm).", ""]
    for title, acts in groups:
        rest = [a for a in acts if id(a) not in listed]
        if rest and not any(_is_offload(a) for a in acts):
            out += [f"### {title}", ""]
            out += _table([_row(parser, a) for a in rest])
    return "\n".join(out).rstrip() + "\n"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--check", action="store_true", help="exit 1 if docs/flags.md is stale; write nothing")
    args = ap.parse_args(argv)
    text = render()
    if args.check:
        current = REFERENCE.read_text() if REFERENCE.exists() else ""
        if current != text:
            print(f"error: {REFERENCE} is stale; regenerate it: {REGENERATE}", file=sys.stderr)
            return 1
        return 0
    REFERENCE.write_text(text)
    print(f"wrote {REFERENCE}: {sum(1 for line in text.splitlines() if line.startswith('| `'))} flags")
    return 0


if __name__ == "__main__":
    sys.exit(main())
