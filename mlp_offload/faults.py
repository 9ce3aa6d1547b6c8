"""Fault injection for the crash tests: ``MLP_OFFLOAD_FAULT="point[@rank][#n][=ERRNO]"`` makes the
process SIGKILL itself the n-th time (default 1) it passes ``fault_point(point)``, on that global
rank only (default: any); with ``=ENOSPC`` (any errno name) it raises that OSError there instead,
as a full disk would. Points: forward, backward, update, save-offload, save-scheduled (--async-save:
the background write just started, not finalized), save-complete, save-tracker, fork.
Unset: a no-op."""

from __future__ import annotations

import errno
import os
import signal
from typing import Dict

_passes: Dict[str, int] = {}


def fault_point(name: str) -> None:
    spec = os.environ.get("MLP_OFFLOAD_FAULT")
    if not spec:
        return
    spec, _, error = spec.partition("=")
    point, _, count = spec.partition("#")
    point, _, rank = point.partition("@")
    if point != name or (rank and rank != os.environ.get("RANK", "0")):
        return
    _passes[name] = _passes.get(name, 0) + 1
    if _passes[name] != int(count or 1):
        return
    if error:
        code = getattr(errno, error)
        raise OSError(code, f"{os.strerror(code)} (injected at {name})")
    os.kill(os.getpid(), signal.SIGKILL)


# "fork": just after the process forked a child. A rank forks only dist_checkpointing's writers,
# so this kills it mid-save with a writer alive.
os.register_at_fork(after_in_parent=lambda: fault_point("fork"))
