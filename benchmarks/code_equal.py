"""Whether the code under some paths is the code of an earlier commit, docstrings and comments aside: each .py
file that differs is parsed both ways with its docstrings removed and the two syntax trees compared. A GPU run
made at that commit then stands for this tree's code there.

    python benchmarks/code_equal.py COMMIT [PATH ...]     (default paths: mlp_offload megatron/training/checkpoint)

Prints one line per differing file ("same code" or "CODE DIFFERS", or added / removed) and exits 1 where any code
differs.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path
from typing import List, Optional

REPO = Path(__file__).resolve().parents[1]
DEFAULT_PATHS = ("mlp_offload", "megatron/training/checkpoint")


def code_of(source: str) -> str:
    """The syntax tree of ``source`` without its docstrings (comments never reach it)."""
    tree = ast.parse(source)
    for node in ast.walk(tree):
        body = getattr(node, "body", None)
        if (isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and body
                and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant)
                and isinstance(body[0].value.value, str)):
            node.body = body[1:] or [ast.Pass()]
    return ast.dump(tree)


def git(*args: str) -> Optional[str]:
    done = subprocess.run(["git", *args], cwd=REPO, capture_output=True, text=True)
    return done.stdout if done.returncode == 0 else None


def compare(commit: str, paths: List[str], against: Optional[str] = None) -> List[str]:
    """One line per .py file under ``paths`` that differs between ``commit`` and ``against`` (None: the working
    tree)."""
    changed = (git("diff", "--name-only", commit, *([against] if against else []), "--", *paths) or "").split()
    lines = []
    for name in sorted(n for n in changed if n.endswith(".py")):
        old = git("show", f"{commit}:{name}")
        if against:
            new = git("show", f"{against}:{name}")
        else:
            new = (REPO / name).read_text() if (REPO / name).exists() else None
        if old is None or new is None:
            lines.append(f"{name}: {'added' if old is None else 'removed'}")
        else:
            lines.append(f"{name}: {'same code' if code_of(old) == code_of(new) else 'CODE DIFFERS'}")
    return lines


def main(argv: List[str]) -> int:
    if not argv:
        sys.exit(__doc__)
    lines = compare(argv[0], argv[1:] or list(DEFAULT_PATHS))
    print("\n".join(lines) or f"no .py file differs from {argv[0]}")
    return 0 if all(line.endswith(": same code") for line in lines) else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
