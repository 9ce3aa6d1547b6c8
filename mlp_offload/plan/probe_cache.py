"""The bandwidth probe's cache: one file per host in the tier directory, written by rename.

Per host, because on a path that every node uses (a parallel file system) each node's rate is its
own (its link, its share of the servers): one node's measurement must not stand for all. No lock
lives on the tier's file system, whose ``flock`` may be missing or local to each node: the node's
probes of a path are serialized by a node-local lock, and a cache file is written whole under a
temporary name and renamed into place, which every node's readers see atomically.
"""

from __future__ import annotations

import json
import logging
import os
import socket
import time
from contextlib import contextmanager
from typing import Optional

from ..config import TierBandwidth
from ..tiers.tokens import LockDir

log = logging.getLogger("mlp_offload")
PREFIX = ".mlp_offload_probe."
MAX_AGE_S = 7 * 24 * 3600


def path_for(root: str, host: Optional[str] = None) -> str:
    host = host or socket.gethostname()
    return os.path.join(root, PREFIX + "".join(c if c.isalnum() or c in "-_." else "_" for c in host) + ".json")


@contextmanager
def node_lock(root: str, lock_root: Optional[str] = None):
    """One probe of ``root`` at a time on this node (the node's ranks start together); the lock
    file lies under ``lock_root`` (None: ``tokens.default_lock_root``)."""
    with LockDir(root, lock_root) as locks, locks.exclusive("probe.lock"):
        yield


def read(path: str, signature: dict) -> Optional[TierBandwidth]:
    try:
        with open(path) as f:
            data = json.load(f)
        if any(data.get(k) != v for k, v in signature.items()):
            return None
        if time.time() - data["measured_at"] > MAX_AGE_S:
            return None
        return TierBandwidth(data["read_bps"], data["write_bps"], data.get("mixed_bps"),
                             data.get("shared_mixed_bps"))
    except (OSError, ValueError, KeyError, TypeError):
        return None  # absent or unreadable cache: measure again


def write(path: str, signature: dict, rate: TierBandwidth, tier_name: str) -> None:
    tmp = f"{path}.tmp-{os.getpid()}"
    try:
        with open(tmp, "w") as f:
            json.dump({**signature, "host": socket.gethostname(), "read_bps": rate.read_bps,
                       "write_bps": rate.write_bps, "mixed_bps": rate.mixed_bps,
                       "shared_mixed_bps": rate.shared_mixed_bps, "measured_at": time.time()}, f)
        os.replace(tmp, path)
    except OSError as err:
        log.warning("tier %s: could not cache the bandwidth probe in %s: %s", tier_name, path, err)
        try:
            os.unlink(tmp)
        except OSError:
            pass
