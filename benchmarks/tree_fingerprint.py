"""A fingerprint of the code a GPU run ran: the SHA-256 of every .py file under mlp_offload/, megatron/, tools/,
benchmarks/ and tests/ and of pretrain_gpt.py and setup.py (paths and contents, in path order). The device's copy
of the tree may carry stale git metadata, so the suite prints this beside the commit it was told; run here at a
commit, it says whether a result belongs to it.

    python benchmarks/tree_fingerprint.py            (this tree)
"""

from __future__ import annotations

import hashlib
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
ROOTS = ("mlp_offload", "megatron", "tools", "benchmarks", "tests")
FILES = ("pretrain_gpt.py", "setup.py")


def code_files(repo: Path = REPO):
    paths = [p for root in ROOTS for p in (repo / root).rglob("*.py") if "__pycache__" not in p.parts]
    paths += [repo / name for name in FILES if (repo / name).exists()]
    return sorted(paths, key=lambda p: p.relative_to(repo).as_posix())


def fingerprint(repo: Path = REPO) -> str:
    digest = hashlib.sha256()
    for path in code_files(repo):
        digest.update(path.relative_to(repo).as_posix().encode() + b"\0")
        digest.update(hashlib.sha256(path.read_bytes()).digest())
    return digest.hexdigest()[:16]


if __name__ == "__main__":
    print(fingerprint(Path(sys.argv[1]) if len(sys.argv) > 1 else REPO))
