"""Write megatron/training/args/megatron_lm_flags.txt: the option names Megatron-LM's own parsers declare, read from
the source of its argument files (every string starting with "--" passed to an ``add_argument`` call; nothing is
imported or run). The list lets an unknown flag be told apart as Megatron-LM's (not built here) from a typo, and
lets docs/flags.md's test check that what it files under Megatron-LM's flags is theirs.

    M=path/to/Megatron-LM; for t in core_v0.15.3 core_v0.16.1; do
      git -C $M show $t:megatron/training/arguments.py > /tmp/$t.py; done
    git -C $M show core_v0.16.1:megatron/post_training/arguments.py > /tmp/post.py
    git -C $M show d98e8a64dd:megatron/training/arguments.py > /tmp/d98e8a64dd.py
    python tools/gen_upstream_flags.py \
      --source "core_v0.15.3 megatron/training/arguments.py" /tmp/core_v0.15.3.py \
      --source "core_v0.16.1 megatron/training/arguments.py" /tmp/core_v0.16.1.py \
      --source "core_v0.16.1 megatron/post_training/arguments.py" /tmp/post.py \
      --source "main at d98e8a64dd megatron/training/arguments.py" /tmp/d98e8a64dd.py

From 0.16 on, Megatron-LM also derives flags from config dataclasses (``ArgumentGroupFactory``); those are not in
the list unless a literal ``add_argument`` names them too.

Each file is given after the ``--source`` text that names where it came from (the tag and path), which the list's
header records.
"""

from __future__ import annotations

import argparse
import ast
from pathlib import Path
from typing import Iterable, List, Set

REPO = Path(__file__).resolve().parent.parent
OUTPUT = REPO / "megatron" / "training" / "args" / "megatron_lm_flags.txt"


def declared_flags(source: str) -> Set[str]:
    """The "--" option strings of every ``*.add_argument(...)`` call in Python source ``source``."""
    flags = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "add_argument":
            flags.update(a.value for a in node.args
                         if isinstance(a, ast.Constant) and isinstance(a.value, str) and a.value.startswith("--"))
    return flags


def render(sources: List[str], flags: Iterable[str]) -> str:
    header = ["# Option names declared by Megatron-LM's argument parsers (tools/gen_upstream_flags.py), from:"]
    header += [f"#   {s}" for s in sources]
    return "\n".join(header + sorted(set(flags))) + "\n"


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--source", action="append", required=True, help="where the next file came from")
    p.add_argument("files", nargs="+")
    args = p.parse_intermixed_args(argv)
    if len(args.source) != len(args.files):
        p.error(f"{len(args.source)} --source texts for {len(args.files)} files: give one before each file")
    flags = set()
    for path in args.files:
        flags |= declared_flags(Path(path).read_text())
    OUTPUT.write_text(render(args.source, flags))
    print(f"{OUTPUT.relative_to(REPO)}: {len(flags)} flags from {len(args.files)} files")


if __name__ == "__main__":
    main()
