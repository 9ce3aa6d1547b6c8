"""The one line for arguments the parser does not take: each unknown flag with what it most likely is, a flag of
Megatron-LM's that this fork does not build (their names: megatron_lm_flags.txt, tools/gen_upstream_flags.py) or a
near miss of a flag it takes."""

from __future__ import annotations

import difflib
from functools import lru_cache
from pathlib import Path
from typing import Iterable, List

UPSTREAM_LIST = Path(__file__).with_name("megatron_lm_flags.txt")


@lru_cache(maxsize=1)
def megatron_lm_flags() -> frozenset:
    lines = UPSTREAM_LIST.read_text().splitlines()
    return frozenset(line for line in lines if line.startswith("--"))


def unknown_arguments_line(leftover: List[str], known: Iterable[str]) -> str:
    """``unrecognized arguments: ...`` as argparse says it, then a note for each unknown flag that has one."""
    known = sorted(set(known))
    notes = []
    for token in leftover:
        flag = token.split("=", 1)[0]
        if not flag.startswith("--") or flag in known:
            continue  # a value, or a known flag given where argparse could not take it
        near = difflib.get_close_matches(flag, known, n=1, cutoff=0.8)
        if near:
            notes.append(f"{flag}: did you mean {near[0]}?")
        elif flag in megatron_lm_flags():
            notes.append(f"{flag}: Megatron-LM's, not built here")
    line = f"unrecognized arguments: {' '.join(leftover)}"
    if notes:
        line += f" ({'; '.join(notes)}; docs/flags.md lists the flags taken)"
    return line
