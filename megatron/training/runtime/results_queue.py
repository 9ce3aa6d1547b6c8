"""The checkpoint writers' results queue, served by a process that never unpickles the results.

megatron-core's writers put their results (torch.distributed.checkpoint ``WriteResult``s) into a
multiprocessing Manager's queue, so that a forked async-save caller can hand them to the rank. A
plain Manager queue unpickles each result in its server, which then imports torch on the first
save: seconds of CPU and hundreds of MB of memory per rank, for a queue (docs/design.md, "Signals
and errors"). This queue's proxy pickles on the caller's side and the server holds bytes. Standard
library only: the spawned server imports this module to find the queue's class.

On Linux the server listens on an abstract socket (a name, no file): a Manager's default socket file goes under
``$TMPDIR``, and where that path is long (a node-local scratch nested deep) it passes the 107 bytes an AF_UNIX
path may take and the server dies at start-up. Its authentication key guards it as before.
"""

from __future__ import annotations

import os
import queue
import secrets
import sys
from multiprocessing.managers import BaseProxy, SyncManager
from multiprocessing.reduction import ForkingPickler


class _BytesQueue:
    """The server's side: pickled results, first in, first out."""

    def __init__(self):
        self._items = queue.Queue()

    def put(self, data: bytes) -> None:
        self._items.put(data)

    def get_nowait(self) -> bytes:
        return self._items.get_nowait()  # queue.Empty reaches the caller as itself


class PickledQueueProxy(BaseProxy):
    """What megatron-core calls on the queue: ``put(results)`` and ``get_nowait()``."""

    _exposed_ = ("put", "get_nowait")

    def put(self, obj) -> None:
        self._callmethod("put", (bytes(ForkingPickler.dumps(obj)),))

    def get_nowait(self):
        return ForkingPickler.loads(self._callmethod("get_nowait"))


class ResultsManager(SyncManager):
    """A SyncManager that also serves ``PickledQueue()``; on Linux, at an abstract socket address unless one is
    given."""

    def __init__(self, address=None, **kwargs):
        if address is None and sys.platform.startswith("linux"):
            address = f"\0mlp-offload-results-{os.getpid()}-{secrets.token_hex(8)}"
        super().__init__(address, **kwargs)

    @property
    def server_pid(self) -> int:
        """The process id of the manager's server (multiprocessing keeps it as its own ``_process``)."""
        return self._process.pid


ResultsManager.register("PickledQueue", _BytesQueue, PickledQueueProxy)
