"""Fault injection for the crash tests, configured by the caller (the Megatron adapter reads
``MLP_OFFLOAD_FAULT`` and ``MLP_OFFLOAD_DELAY``; the engine reads no environment):
``configure(fault="point[@rank][#n][=ERRNO]")`` makes the process SIGKILL itself the n-th time (default 1) it passes ``fault_point(point)``, on that global
rank only (default: any); with ``=ENOSPC`` (any errno name) it raises that OSError there instead,
as a full disk would. Points: forward, backward, update, save-offload (once per subgroup written
into a checkpoint, by the background writer with --async-save), save-offload-commit (a state file
and its part files written and fsynced, the file not yet renamed), save-scheduled (--async-save: the
background write just started, not finalized), save-complete, save-tracker, fork.

``configure(delay="point=SECONDS[,point=SECONDS...]")`` sleeps at every pass of those points
instead: a slow disk, e.g. to show that training goes on while a background save is written.
Neither given: a no-op. Forked processes inherit the configuration."""

from __future__ import annotations

import errno
import os
import signal
import time
from typing import Dict, Optional

_passes: Dict[str, int] = {}
_fault: Optional[str] = None
_delays: Optional[str] = None
_rank = "0"


def configure(fault: Optional[str] = None, delay: Optional[str] = None, rank: int = 0) -> None:
    """Set this process's fault and delay points (None: none); passes are counted afresh."""
    global _fault, _delays, _rank
    _fault, _delays, _rank = fault or None, delay or None, str(rank)
    _passes.clear()


def enabled() -> bool:
    return bool(_fault or _delays)


def fault_point(name: str) -> None:
    if _delays:
        _delay(name, _delays)
    if not _fault:
        return
    spec, _, error = _fault.partition("=")
    point, _, count = spec.partition("#")
    point, _, rank = point.partition("@")
    if point != name or (rank and rank != _rank):
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
