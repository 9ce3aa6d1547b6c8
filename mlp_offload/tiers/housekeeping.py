"""Swap-file namespaces: ``<tier path>/mlp_offload/<run id>/rank<r>/``, each with an OWNER.json.

A rank claims its namespace at start-up. Files left by a dead process are recognised (the owner's
pid is gone, or now belongs to a process that started later) and are reported, never reused:
our own namespace is cleared before use, others are listed so the user can delete them
(``python tools/offload_clean.py PATH``).
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import socket
import threading
import time
from dataclasses import dataclass
from typing import List, Optional
from ..config.units import GiB

log = logging.getLogger("mlp_offload")
NAMESPACE_DIR = "mlp_offload"
OWNER_FILE = "OWNER.json"


_owned = set()  # namespaces this process claimed and has not released
_owned_lock = threading.Lock()
_reported_roots = set()  # tier roots whose stale namespaces this process has listed


class NamespaceInUseError(RuntimeError):
    """Another live process owns the namespace this rank would use."""


@dataclass
class Namespace:
    path: str
    run_id: str
    rank_dir: str
    owner: Optional[dict]
    alive: Optional[bool]  # None: owned by another host, liveness unknown
    nbytes: int

    def describe(self) -> str:
        who = "unknown owner" if not self.owner else (
            f"pid {self.owner.get('pid')} on {self.owner.get('host')}, started "
            f"{time.strftime('%Y-%m-%d %H:%M:%S', time.localtime(self.owner.get('started', 0)))}")
        return f"{self.path} ({self.nbytes / GiB:.2f} GiB, {who})"


def _proc_start_ticks(pid: int) -> Optional[int]:
    """The process's start time in clock ticks since boot (Linux), to tell a recycled pid apart."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return int(f.read().rsplit(")", 1)[1].split()[19])
    except (OSError, IndexError, ValueError):
        return None


def owner_record() -> dict:
    pid = os.getpid()
    return {"host": socket.gethostname(), "pid": pid, "start_ticks": _proc_start_ticks(pid), "started": time.time()}


def owner_alive(owner: Optional[dict]) -> Optional[bool]:
    if not owner or "pid" not in owner:
        return False
    if owner.get("host") != socket.gethostname():
        return None
    pid = int(owner["pid"])
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass  # exists, owned by someone else
    recorded, now = owner.get("start_ticks"), _proc_start_ticks(pid)
    return recorded is None or now is None or recorded == now


def read_owner(rank_dir: str) -> Optional[dict]:
    try:
        with open(os.path.join(rank_dir, OWNER_FILE)) as f:
            return json.load(f)
    except (OSError, ValueError):
        return None


def scan(root: str) -> List[Namespace]:
    """Every rank namespace under ``root/mlp_offload``, with its owner's status and size."""
    base = os.path.join(root, NAMESPACE_DIR)
    found = []
    for run_id in sorted(_listdir(base)):
        for rank_dir in sorted(_listdir(os.path.join(base, run_id))):
            path = os.path.join(base, run_id, rank_dir)
            if os.path.isdir(path) and ".tmp-" not in rank_dir:
                owner = read_owner(path)
                found.append(Namespace(path, run_id, rank_dir, owner, owner_alive(owner), tree_bytes(path)))
    return found


def claim(root: str, run_id: str, rank: int, field: str, reports_stale: bool = True) -> str:
    """Create and own this rank's namespace; clear a dead owner's files; report other stale ones
    (where ``reports_stale``: the node's first rank)."""
    path = os.path.join(root, NAMESPACE_DIR, run_id, f"rank{rank:05d}")
    if os.path.isdir(path):
        owner = read_owner(path)
        ours = owner and owner.get("pid") == os.getpid() and owner.get("host") == socket.gethostname()
        if not ours:
            alive = owner_alive(owner)
            ns = Namespace(path, run_id, os.path.basename(path), owner, alive, tree_bytes(path))
            if alive is not False:
                raise NamespaceInUseError(
                    f"{field} {root}: {ns.describe()} is in use by another process with the same run id "
                    f"{run_id!r} and rank {rank}; give each job its own MLP_OFFLOAD_RUN_ID")
            log.warning("removing stale offload files of a dead run before use (never reused): %s", ns.describe())
            shutil.rmtree(path, ignore_errors=True)
    if not os.path.isdir(path):
        # Built under a temporary name and renamed into place, so a namespace is never seen
        # without its owner record (another rank scanning meanwhile would call it dead).
        tmp = f"{path}.tmp-{os.getpid()}"
        with _owned_lock:
            _owned.add(tmp)  # a SIGTERM right now must not leave it behind either
        _makedirs_beside_releases(tmp)
        with open(os.path.join(tmp, OWNER_FILE), "w") as f:
            json.dump(owner_record(), f)
        with _owned_lock:
            os.rename(tmp, path)
            _owned.discard(tmp)
    else:
        with open(os.path.join(path, OWNER_FILE), "w") as f:
            json.dump(owner_record(), f)
    with _owned_lock:
        _owned.add(path)
    stale = [ns for ns in scan(root) if ns.path != path and ns.alive is False]
    # The same list on every rank and for every claim of this root (the probe's, then training's):
    # once per node and root.
    if stale and reports_stale and root not in _reported_roots:
        _reported_roots.add(root)
        log.warning(
            "%s %s holds %d stale offload namespace(s) of dead runs (%.2f GiB); they are not used. "
            "Delete them with: python tools/offload_clean.py --delete %s\n  %s",
            field, root, len(stale), sum(ns.nbytes for ns in stale) / GiB, root,
            "\n  ".join(ns.describe() for ns in stale))
    return path


def _makedirs_beside_releases(path: str, attempts: int = 5) -> None:
    """os.makedirs, again if a parent vanished meanwhile: another rank's release() removes the run's
    and the base directory once they look empty (its probe finishing while this rank claims)."""
    for attempt in range(attempts):
        try:
            os.makedirs(path, exist_ok=True)
            return
        except FileNotFoundError:
            if attempt == attempts - 1:
                raise


def release(path: str, passes: int = 20) -> None:
    """Remove a namespace this process claimed: its files first, its OWNER.json last, so a removal
    cut short (SIGKILL) still leaves a namespace that start-up recognises as a dead run's.

    On SIGTERM this runs while the engine's I/O threads may still be writing: a file they create after
    a pass looked is removed by the next pass (up to ``passes``), until a pass finds none."""
    with _owned_lock:
        _owned.discard(path)
        for _ in range(passes):
            if not _remove_contents(path):
                break
        remove_file(os.path.join(path, OWNER_FILE))
        for _ in range(passes):
            _rmdir(path)
            if not os.path.exists(path) or not _remove_contents(path, keep_owner=False):
                break
        for directory in (os.path.dirname(path), os.path.dirname(os.path.dirname(path))):
            _rmdir(directory)  # the run's and the base directory go once empty


def _remove_contents(path: str, keep_owner: bool = True) -> int:
    """One pass over a namespace: its files (but its OWNER.json where ``keep_owner``) and its
    sub-directories removed; how many entries it found to remove."""
    found = 0
    for dirpath, dirs, files in os.walk(path, topdown=False):
        for name in files:
            if not (keep_owner and dirpath == path and name == OWNER_FILE):
                remove_file(os.path.join(dirpath, name))
                found += 1
        for name in dirs:
            _rmdir(os.path.join(dirpath, name))
            found += 1
    return found


def release_all() -> None:
    """Remove every namespace this process still owns (on SIGTERM, whatever the engine is doing)."""
    with _owned_lock:
        owned = sorted(_owned)
    for path in owned:
        release(path)


def remove_file(path: str) -> None:
    """Remove the file at ``path``; one already gone (or not removable) is left as it is."""
    try:
        os.unlink(path)
    except OSError:
        pass


def _rmdir(path: str) -> None:
    try:
        os.rmdir(path)
    except OSError:
        pass


def _listdir(path: str) -> List[str]:
    try:
        return os.listdir(path)
    except OSError:
        return []


def tree_bytes(path: str) -> int:
    """Bytes of the files under ``path`` (files removed meanwhile count nothing)."""
    total = 0
    for dirpath, _, files in os.walk(path):
        for name in files:
            try:
                total += os.path.getsize(os.path.join(dirpath, name))
            except OSError:
                pass
    return total
