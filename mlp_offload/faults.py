"""Fault injection for the crash tests: ``MLP_OFFLOAD_FAULT="point[@rank][#n][=ERRNO]"`` makes the
process SIGKILL itself the n-th time (default 1) it passes ``fault_point(point)``, on that global
rank only (default: any); with ``=ENOSPC`` (any errno name) it raises that OSError there instead,
as a full disk would. Points: forward, backward, update, save-offload (once per subgroup written
into a checkpoint, by the background writer with --async-save), save-scheduled (--async-save: the
background write just started, not finalized), save-complete, save-tracker, fork.

``MLP_OFFLOAD_DELAY="point=SECONDS[,point=SECONDS...]"`` sleeps at every pass of those points
instead: a slow disk, e.g. to show that training goes on while a background save is written.
Both unset: a no-op."""

from __future__ import annotations

import errno
import os
import signal
import time
from typing import Dict

_passes: Dict[str, int] = {}


def fault_point(name: str) -> None:
    delays = os.environ.get("MLP_OFFLOAD_DELAY")
    if delays:
        _delay(name, delays)
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


def _delay(name: str, delays: str) -> None:
    for item in delays.split(","):
        point, _, seconds = item.partition("=")
        if point.strip() == name:
            time.sleep(float(seconds))


# "fork": just after the process forked a child. A rank forks only dist_checkpointing's writers,
# so this kills it mid-save with a writer alive.
os.register_at_fork(after_in_parent=lambda: fault_point("fork"))
