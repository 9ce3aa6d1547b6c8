"""--async-save: a checkpoint's torch_dist files are written by a background process while training
goes on, and the checkpoint is completed later, in a finalize step.

megatron-core's ``AsyncCallsQueue`` runs the write. Its non-persistent caller forks one process per
save (on CPU the fork itself is the snapshot: the preload step does not copy CPU tensors, and the
child sees memory as it was at the fork); the persistent caller would spawn a worker and pass the
tensors through shared memory, which our CPU/gloo runs do not need.

The finalize step is collective. ``poll()`` (after every iteration) finalizes only when every rank's
writer has ended; ``finish()`` waits for them (before the next save, before exit). Finalizing runs
megatron-core's own finalize functions (the global ``.metadata``, ``metadata.json``), turns a failed
write into a message, and hands it to ``on_written``, which makes all ranks agree and completes the
checkpoint (the proof, then the tracker). Until then the directory holds its in-progress marker, so
a crash leaves the previous checkpoint as the one resumed.
"""

from __future__ import annotations

from typing import Callable, Optional

import torch
from torch.distributed.checkpoint import CheckpointException
from megatron.core.dist_checkpointing.strategies.async_utils import AsyncCallsQueue, AsyncRequest

# on_written(failure): failure is None when this rank's write succeeded, else a one-line reason.
OnWritten = Callable[[Optional[str]], None]


class BackgroundSaves:
    """At most one checkpoint being written in the background (a new save finishes the last first)."""

    def __init__(self):
        self._queue = AsyncCallsQueue(persistent=False)

    @property
    def pending(self) -> bool:
        return self._queue.get_num_unfinalized_calls() > 0

    def schedule(self, request: AsyncRequest, on_written: OnWritten) -> None:
        """Start writing (every rank calls this); ``on_written`` runs in the finalize step."""
        if self.pending:
            raise RuntimeError("a background checkpoint write is still pending: finish() it first")
        finalize = _finalize_then(request.finalize_fns, on_written)
        self._queue.schedule_async_request(request._replace(finalize_fns=[finalize]))

    def poll(self) -> None:
        """Finalize if every rank's writer has ended; otherwise return at once (one all-reduce)."""
        if self.pending:
            self._queue.maybe_finalize_async_calls(blocking=False)

    def finish(self) -> None:
        """Wait for the background write and finalize it."""
        if self.pending:
            self._queue.maybe_finalize_async_calls(blocking=True)

    def abandon(self) -> None:
        """Stop a pending write unfinalized (the run is failing): its directory stays incomplete."""
        # The queue's own close(abort=True) kills only a persistent worker, so each forked writer here.
        for call in self._queue.async_calls:
            call.async_caller.close(abort=True)
        self._queue = AsyncCallsQueue(persistent=False)


def _finalize_then(finalize_fns, on_written: OnWritten):
    def finalize() -> None:
        failure = None
        try:
            for fn in finalize_fns:
                fn()
        except CheckpointException as err:  # raised on every rank (megatron-core broadcasts it)
            failure = f"rank {torch.distributed.get_rank()}: the background write failed: {_one_line(err)}"
        on_written(failure)

    return finalize


def _one_line(err: Exception) -> str:
    return " ".join(str(err).split())[:500]
