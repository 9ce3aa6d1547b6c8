"""--async-save: a checkpoint's torch_dist files are written by a background process, and the
offloaded optimizer state by a thread of the rank (mlp_offload.checkpoint), while training
goes on; the checkpoint is completed later, in a finalize step.

megatron-core's ``AsyncCallsQueue`` runs the write. Its non-persistent caller forks one process per
save (on CPU the fork itself is the snapshot: the preload step does not copy CPU tensors, and the
child sees memory as it was at the fork); the persistent caller would spawn a worker and pass the
tensors through shared memory, which our CPU/gloo runs do not need.

The writer thread starts after the fork, so the forked process inherits no half-held lock of it.
The forked process runs at the idle I/O priority (runtime.io_priority): megatron-core's writes cannot
be paced from inside, as the offloaded state's are (mlp_offload.checkpoint.pacing).

The finalize step is collective. ``poll()`` (after every iteration) finalizes only when every rank's
writers (process and thread) have ended; ``finish()`` waits for them (before the next save, before
exit). Finalizing runs
megatron-core's own finalize functions (the global ``.metadata``, ``metadata.json``), turns a failed
write into a message, and hands it to ``on_written``, which makes all ranks agree and completes the
checkpoint (the proof, then the tracker). Until then the directory holds its in-progress marker, so
a crash leaves the previous checkpoint as the one resumed.
"""

from __future__ import annotations

import time
from typing import Callable, List, Optional, Protocol, Tuple

import torch
from torch.distributed.checkpoint import CheckpointException
from megatron.core.dist_checkpointing.dict_utils import nested_values
from megatron.core.dist_checkpointing.mapping import ShardedTensor, apply_factories, is_main_replica
from megatron.core.dist_checkpointing.strategies.async_utils import AsyncCallsQueue, AsyncRequest

from megatron.training.errors import UserError
from megatron.training.runtime.io_priority import at_idle_io_priority
from mlp_offload.checkpoint import human_bytes

# on_written(failure): failure is None when this rank's write succeeded, else a one-line reason.
OnWritten = Callable[[Optional[str]], None]


class WriterThread(Protocol):
    """A write of the rank's own beside megatron-core's (mlp_offload's BackgroundStateWrite)."""

    def start(self) -> None: ...
    def done(self) -> bool: ...
    def wait(self) -> None: ...
    def cancel(self) -> None: ...


class BackgroundSaves:
    """At most one checkpoint being written in the background (a new save finishes the last first)."""

    def __init__(self, device: torch.device):
        self._queue = AsyncCallsQueue(persistent=False)
        self._device = device  # of the all-reduce that asks whether every rank's thread has ended
        self._thread: Optional[WriterThread] = None

    @property
    def pending(self) -> bool:
        return self._queue.get_num_unfinalized_calls() > 0

    def schedule(self, request: AsyncRequest, on_written: OnWritten, thread: Optional[WriterThread] = None) -> None:
        """Start writing (every rank calls this, all with a ``thread`` or none); ``on_written`` runs in
        the finalize step, after the thread too has ended."""
        if self.pending:
            raise RuntimeError("a background checkpoint write is still pending: finish() it first")
        finalize = _finalize_then(request.finalize_fns, on_written)
        # The forked writer at the idle I/O priority: the file tiers' step I/O first where the scheduler serves classes.
        write = at_idle_io_priority(request.async_fn) if request.async_fn is not None else None
        self._queue.schedule_async_request(request._replace(async_fn=write, finalize_fns=[finalize]))
        self._thread = thread
        if thread is not None:
            thread.start()

    def poll(self) -> None:
        """Finalize if every rank's writers have ended; otherwise return at once (one or two all-reduces)."""
        if self.pending and self._all_threads_done():
            self._queue.maybe_finalize_async_calls(blocking=False)

    def finish(self) -> None:
        """Wait for the background write and finalize it."""
        if self.pending:
            if self._thread is not None:
                self._thread.wait()
            self._queue.maybe_finalize_async_calls(blocking=True)

    def _all_threads_done(self) -> bool:
        if self._thread is None:
            return True
        done = torch.tensor([int(self._thread.done())], dtype=torch.int32, device=self._device)
        torch.distributed.all_reduce(done, op=torch.distributed.ReduceOp.MIN)
        return bool(done.item())

    def abandon(self) -> None:
        """Stop a pending write unfinalized (the run is failing): its directory stays incomplete."""
        if self._thread is not None:
            self._thread.cancel()  # its partial file goes; the engine is no longer held back
            self._thread = None
        # The queue's own close(abort=True) kills only a persistent worker, so each forked writer here.
        for call in self._queue.async_calls:
            call.async_caller.close(abort=True)
        self._queue = AsyncCallsQueue(persistent=False)


def reserve_host_copies(model_state: dict, fully_parallel: bool) -> Tuple[int, float]:
    """Pin, then free, host memory for each GPU tensor of ``model_state`` (the model's sharded state
    dict, as a save builds it) that a save copies to host: torch keeps freed pinned blocks cached by
    size, so the first --async-save's copy reuses them instead of pinning memory while training
    waits. Of replicated tensors, only the ones this rank writes (all, under fully parallel saves,
    which pick the writer at the save). Returns (bytes, seconds); nothing on a run without CUDA. Host memory
    too short to pin them stops the run here, in one line, before any step (a save would fail later)."""
    sizes = copied_tensor_sizes(model_state, fully_parallel)
    if not sizes or not torch.cuda.is_available():
        return 0, 0.0
    started = time.perf_counter()
    wanted = sum(numel * dtype.itemsize for numel, dtype in sizes)
    try:
        blocks = [torch.empty(numel, dtype=dtype, pin_memory=True) for numel, dtype in sizes]
    except RuntimeError as err:
        reason = (str(err).strip().splitlines() or ["no reason given"])[0]
        raise UserError(f"--async-save: pinning {human_bytes(wanted)} of host memory for its copies of the weights "
                        f"failed ({reason}); give the node's host memory back (a smaller budget of the host tier) or "
                        f"save without --async-save") from None
    nbytes = sum(block.numel() * block.element_size() for block in blocks)
    del blocks  # into torch's cache of pinned blocks
    return nbytes, time.perf_counter() - started


def copied_tensor_sizes(model_state: dict, fully_parallel: bool) -> List[Tuple[int, torch.dtype]]:
    """(numel, dtype) of each GPU tensor a save of ``model_state`` copies to host on this rank."""
    apply_factories(model_state)  # e.g. SwiGLU's fc1 is saved as its two halves
    return [(value.data.numel(), value.data.dtype) for value in nested_values(model_state)
            if isinstance(value, ShardedTensor) and value.data is not None and value.data.is_cuda
            and (fully_parallel or is_main_replica(value.replica_id))]


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
