"""--async-save: a checkpoint's torch_dist files are written by a background process, and the
offloaded optimizer state by a thread of the rank (mlp_offload.checkpoint), while training
goes on; the checkpoint is completed later, in a finalize step.

megatron-core's ``AsyncCallsQueue`` runs the write. Its non-persistent caller forks one process per
save (on CPU the fork itself is the snapshot: the preload step does not copy CPU tensors, and the
child sees memory as it was at the fork); the persistent caller would spawn a worker and pass the
tensors through shared memory, which our CPU/gloo runs do not need.

The writer thread starts after the fork, so the forked process inherits no half-held lock of it.
The forked process runs at the idle I/O priority and nice 19 (runtime.io_priority), and where a file tier shares the
checkpoint's disk megatron-core's workers open their files as paced files (mlp_offload.checkpoint.paced_flush):
each goes to the disk as it is written, behind the tiers' step I/O as the offloaded state's writes do
(mlp_offload.checkpoint.pacing), by O_DIRECT where it can, and its fsync is paced too. All of it is set inside
the forked process only.

The finalize step is collective. ``poll()`` (after every iteration) finalizes only when every rank's
writers (process and thread) have ended; ``finish()`` waits for them (before the next save, before
exit). Finalizing runs
megatron-core's own finalize functions (the global ``.metadata``, ``metadata.json``), turns a failed
write into a message, and hands it to ``on_written``, which makes all ranks agree and completes the
checkpoint (the proof, then the tracker). Until then the directory holds its in-progress marker, so
a crash leaves the previous checkpoint as the one resumed.

With the params in host memory (--offload-params host) the weights a save writes are in DDP's host buffers.
On a GPU those are left out of forked children (``MADV_DONTFORK``, pinned in place: runtime.host_memory), so
the forked writer would read whatever its own memory holds at their addresses; a writer in the rank's own
process would see the next updates change them in place. ``HostWeightsAside`` copies them aside at the save
(on a CPU run too, where the buffers are ordinary memory the fork would keep) and the writer reads the copies.
"""

from __future__ import annotations

import builtins
import contextlib
import dataclasses
import os
import socket
import tempfile
import time
from typing import Callable, List, Optional, Protocol, Sequence, Tuple

import torch
from torch.distributed.checkpoint import CheckpointException
from megatron.core.dist_checkpointing.dict_utils import nested_values
from megatron.core.dist_checkpointing.mapping import ShardedTensor, apply_factories, is_main_replica
from megatron.core.dist_checkpointing.strategies.async_utils import AsyncCallsQueue, AsyncRequest
from megatron.core.dist_checkpointing.strategies.base import AsyncSaveShardedStrategy

from megatron.training.errors import UserError
from megatron.training.runtime.checkpoint_worker import StandingQueue, StandingWorker, staged_bytes
from megatron.training.checkpoint.state_dict import writer_processes
from megatron.training.runtime.io_priority import at_idle_priority
from mlp_offload import GiB, meminfo_bytes
from mlp_offload.checkpoint import FlushPacing, flush_pacing, human_bytes, install_paced_fsync, uninstall_paced_fsync

# on_written(failure): failure is None when this rank's write succeeded, else a one-line reason.
OnWritten = Callable[[Optional[str]], None]
POLLS_KEPT = 4  # the iteration time is the shortest of the gaps between these


def next_save_in_s(iteration: int, save_intervals: Sequence[Optional[int]], train_iters: Optional[int],
                   iteration_s: Optional[float]) -> Optional[float]:
    """About how long until the save after the one at ``iteration``: the iterations to the next multiple of any of
    ``save_intervals`` (None: not set) or to the end of training (``train_iters``), whichever comes first, at
    ``iteration_s`` each; None where no later save is known."""
    last = train_iters if train_iters else float("inf")  # no save after the end of training
    ends = [(iteration // n + 1) * n for n in save_intervals if n] + [train_iters]
    later = [end for end in ends if end is not None and iteration < end <= last]
    if iteration_s is None or not later:
        return None
    return (min(later) - iteration) * iteration_s


class WriterThread(Protocol):
    """A write of the rank's own beside megatron-core's (mlp_offload's BackgroundStateWrite)."""

    def start(self) -> None: ...
    def done(self) -> bool: ...
    def wait(self) -> None: ...
    def cancel(self) -> None: ...
    def yield_to(self, running: Callable[[], bool], until: Optional[float]) -> None: ...


class BackgroundSaves:
    """At most one checkpoint being written in the background (a new save finishes the last first)."""

    def __init__(self, device: torch.device, worker: Optional[StandingWorker] = None):
        self._worker = worker  # --use-persistent-ckpt-worker: it writes torch_dist's files, no fork at a save
        self._queue = self._new_queue()
        self._device = device  # of the all-reduce that asks whether every rank's thread has ended
        self._thread: Optional[WriterThread] = None
        self._flush: Optional[FlushPacing] = None
        self._polled: List[float] = []  # when the last polls ran: one after each iteration

    @property
    def pending(self) -> bool:
        return self._queue.get_num_unfinalized_calls() > 0

    def schedule(self, request: AsyncRequest, on_written: OnWritten, thread: Optional[WriterThread] = None,
                 flush: Optional[FlushPacing] = None) -> None:
        """Start writing (every rank calls this, all with a ``thread`` or none); ``on_written`` runs in
        the finalize step, after the thread too has ended. ``flush``: the forked writer's fsyncs paced so."""
        if self.pending:
            raise RuntimeError("a background checkpoint write is still pending: finish() it first")
        callers = []  # this call's, once scheduled: a standing worker's says how its write failed
        finalize = _finalize_then(request.finalize_fns, on_written,
                                  lambda: getattr(callers[0], "failure", None) if callers else None)
        write = forked_writer(request.async_fn, flush) if request.async_fn is not None else None
        first = flush if flush is not None and flush.running_path is not None and write is not None else None
        forking = first is not None and self._worker is None  # the standing worker takes the lock with the write
        with first.held_across_fork() if forking else contextlib.nullcontext():
            self._queue.schedule_async_request(request._replace(async_fn=write, finalize_fns=[finalize]))
        callers.append(self._queue.async_calls[-1].async_caller)
        if thread is not None and first is not None:  # its flushes are due first: the thread waits for them
            thread.yield_to(first.writer_running, first.due_at)
        self._thread, self._flush = thread, flush
        if thread is not None:
            thread.start()

    def _new_queue(self) -> AsyncCallsQueue:
        return StandingQueue(self._worker) if self._worker is not None else AsyncCallsQueue(persistent=False)

    def iteration_s(self) -> Optional[float]:
        """The shortest of the last few iterations, as the polls after them saw it (None before two polls): a
        save or an evaluation between two polls lengthens that gap only."""
        gaps = [later - earlier for earlier, later in zip(self._polled, self._polled[1:])]
        return min(gaps) if gaps else None

    def poll(self) -> None:
        """Finalize if every rank's writers have ended; otherwise return at once (one or two all-reduces)."""
        self._polled = (self._polled + [time.perf_counter()])[-POLLS_KEPT:]
        if self.pending and self._all_threads_done():
            self._queue.maybe_finalize_async_calls(blocking=False)

    def finish(self) -> None:
        """Wait for the background write and finalize it."""
        if self.pending:
            if self._thread is not None:
                self._thread.wait()
            self._queue.maybe_finalize_async_calls(blocking=True)

    def close(self) -> None:
        """After ``finish``: the standing worker, where there is one, ends."""
        if self._worker is not None:
            self._worker.close()
            self._worker = None

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
        # The queue's own close(abort=True) kills only megatron-core's persistent worker, so each writer here.
        for call in self._queue.async_calls:
            call.async_caller.close(abort=True)
        self._worker = None  # killed, where there was one: later saves (none, the run failing) would fork
        self._queue = self._new_queue()
        if self._flush is not None and self._flush.report_path is not None:  # its report is read no more
            _remove(self._flush.report_path)
        self._flush = None


def torch_dist_flush(shards, path: str, next_save_in_s: Optional[float] = None) -> Optional[FlushPacing]:
    """How the forked writer of a save into ``path`` paces its fsyncs, behind the file tiers of the offload
    engines of ``shards`` on its disk (None: plain fsyncs), done before the next save (``next_save_in_s``, where
    known); its processes report into a file of their own."""
    pacing = flush_pacing([shard.engine for shard in shards], path, writer_processes(), next_save_in_s)
    if pacing is None:
        return None
    handle, report = tempfile.mkstemp(prefix="mlp_offload_torch_dist_flushes-")  # only where there is one to read
    os.close(handle)
    return dataclasses.replace(pacing, report_path=report)


def _remove(path: str) -> None:
    try:
        os.unlink(path)
    except OSError:
        pass


@dataclasses.dataclass(frozen=True)
class BackgroundWrite:
    """``write`` (megatron-core's) at the idle I/O priority and nice 19, so the file tiers' step I/O (where the
    scheduler serves classes) and the rank's threads go first; with ``flush``, its fsyncs paced behind the tiers.
    Both only where it runs in another process than the rank (``rank_pid``): the rank's own stay as they are. A
    value, not a closure: the standing worker (runtime.checkpoint_worker) gets it over a socket."""
    write: Callable
    flush: Optional[FlushPacing]
    rank_pid: int

    def __call__(self, *args, **kwargs):
        if os.getpid() == self.rank_pid:  # run in the rank itself: nothing of the rank's is changed
            return self.write(*args, **kwargs)
        # inherited by the workers it forks, one per file
        paced_open = install_paced_fsync(self.flush) if self.flush is not None else None
        if paced_open is not None:
            _files_written_paced(paced_open, bucket_bytes(args))
        try:
            return at_idle_priority(self.write)(*args, **kwargs)
        finally:
            if paced_open is not None:  # a standing worker's next write is paced by its own save's plan
                _files_written_plainly()
                uninstall_paced_fsync()


def forked_writer(write: Callable, flush: Optional[FlushPacing]) -> BackgroundWrite:
    """``write`` as the background writer of this rank runs it (BackgroundWrite)."""
    return BackgroundWrite(write, flush, os.getpid())


def bucket_bytes(args: Sequence) -> dict:
    """File path -> the bytes megatron-core's writer will put in it, from its write buckets among ``args`` (each
    ``(path, storage key, (bytes items, tensor items))``); empty where there are none."""
    sizes = {}
    for arg in args:
        if not isinstance(arg, list):
            continue
        for bucket in arg:
            if not (isinstance(bucket, tuple) and len(bucket) == 3 and isinstance(bucket[0], str)):
                continue
            _, _, (bytes_items, tensor_items) = bucket
            sizes[bucket[0]] = (sum(data.getbuffer().nbytes for _, data in bytes_items)
                                + sum(tensor.untyped_storage().nbytes() for _, tensor in tensor_items))
    return sizes


def _files_written_paced(paced_open: Callable, sizes: dict) -> None:
    """megatron-core's writer workers (in this forked process and those it forks) open their files through
    ``paced_open``: each file goes to the disk as it is written, paced (mlp_offload.checkpoint.paced_flush)."""
    from megatron.core.dist_checkpointing.strategies import filesystem_async

    def open_for_writing(file, mode="r", *args, **kwargs):
        if mode == "wb" and not args and not kwargs:
            return paced_open(os.fspath(file), sizes.get(os.fspath(file), 0))
        return builtins.open(file, mode, *args, **kwargs)

    filesystem_async.open = open_for_writing  # the module's name for the builtin, in this process only


def _files_written_plainly() -> None:
    """``_files_written_paced`` undone: the module's ``open`` the builtin again."""
    from megatron.core.dist_checkpointing.strategies import filesystem_async
    filesystem_async.__dict__.pop("open", None)


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


def reserve_worker_staging(worker: StandingWorker, model_state: dict, fully_parallel: bool) -> str:
    """--use-persistent-ckpt-worker: the staging its saves copy the weights into, made now (a save that writes more,
    an optimizer state in torch_dist's files, makes it again, larger); the line that says so."""
    started = time.perf_counter()
    worker.reserve(staged_bytes(copied_tensor_sizes(model_state, fully_parallel, gpu_only=False)))
    return (f"> --async-save: {human_bytes(worker.staging.size)} of host memory (rank 0) kept as the staging of the "
            f"checkpoint worker made at start-up (pid {worker.pid}), made in {time.perf_counter() - started:.1f} s")


def copied_tensor_sizes(model_state: dict, fully_parallel: bool,
                        gpu_only: bool = True) -> List[Tuple[int, torch.dtype]]:
    """(numel, dtype) of each GPU tensor (``gpu_only``; else each tensor) a save of ``model_state`` copies to host
    on this rank."""
    apply_factories(model_state)  # e.g. SwiGLU's fc1 is saved as its two halves
    return [(value.data.numel(), value.data.dtype) for value in nested_values(model_state)
            if isinstance(value, ShardedTensor) and value.data is not None and (value.data.is_cuda or not gpu_only)
            and (fully_parallel or is_main_replica(value.replica_id))]


class HostWeightsAside:
    """--async-save with the params in host memory: each weight the save writes from ``host_buffers`` (DDP's
    param buffers in host memory) is copied into a tensor of its own (ordinary memory, which a fork keeps)
    before torch_dist plans the write, so the forked writer reads the copy. A tensor of its own (its storage
    exactly its size): megatron-core's plan clones a CPU view of a larger storage, but not that, so the
    weights are copied once. The copies go with the save's request, once the writer has ended."""

    def __init__(self, host_buffers: List[torch.Tensor]):
        self.spans = [(b.data_ptr(), b.data_ptr() + b.numel() * b.element_size()) for b in host_buffers]
        self.copied_bytes = 0  # of the last save, and the seconds its copies held training
        self.copy_s = 0.0

    def wrapping(self, strategy: AsyncSaveShardedStrategy) -> AsyncSaveShardedStrategy:
        """``strategy`` copying the host weights aside first (put it under the fully parallel wrapper, which
        picks each replicated tensor's writer: this rank copies only what it writes)."""
        return _CopyingAsideFirst(strategy, self)

    def in_host_buffers(self, tensor: torch.Tensor) -> bool:
        start = tensor.data_ptr()
        return tensor.device.type == "cpu" and any(lo <= start < hi for lo, hi in self.spans)

    def bytes_written(self, sharded_state_dict: dict, data_parallel_size: int) -> int:
        """About what a save copies on this rank, before the fully parallel wrapper picks the writers:
        the main replicas, or with ``data_parallel_size`` > 1 a share of every host weight."""
        apply_factories(sharded_state_dict)  # e.g. SwiGLU's fc1 is saved as its two halves
        tensors = [v for v in nested_values(sharded_state_dict)
                   if isinstance(v, ShardedTensor) and v.data is not None and self.in_host_buffers(v.data)]
        if data_parallel_size > 1:
            return sum(v.data.numel() * v.data.element_size() for v in tensors) // data_parallel_size
        return sum(v.data.numel() * v.data.element_size() for v in tensors if is_main_replica(v.replica_id))

    def copy_aside(self, sharded_state_dict: dict) -> None:
        """The weights this rank writes out of the host buffers replaced by copies, once each node's ranks
        agree its host memory holds them (or all stop in one line)."""
        live = [value for value in nested_values(sharded_state_dict)
                if isinstance(value, ShardedTensor) and value.data is not None
                and is_main_replica(value.replica_id) and self.in_host_buffers(value.data)]
        needed = sum(value.data.numel() * value.data.element_size() for value in live)
        check_nodes_hold(needed, "a save copies the params it writes aside while the writer reads them")
        started = time.perf_counter()
        for value in live:
            copy = torch.empty(value.data.shape, dtype=value.data.dtype)
            copy.copy_(value.data)
            value.data = copy
        self.copied_bytes, self.copy_s = needed, time.perf_counter() - started


class _CopyingAsideFirst(AsyncSaveShardedStrategy):
    """A torch_dist save strategy whose async save copies the host weights aside first."""

    def __init__(self, base: AsyncSaveShardedStrategy, aside: HostWeightsAside):
        super().__init__(base.backend, base.version)
        self.base, self.aside = base, aside

    @property
    def can_handle_sharded_objects(self):
        return self.base.can_handle_sharded_objects

    def async_save(self, sharded_state_dict, checkpoint_dir) -> AsyncRequest:
        self.aside.copy_aside(sharded_state_dict)
        return self.base.async_save(sharded_state_dict, checkpoint_dir)

    def save(self, sharded_state_dict, checkpoint_dir):
        return self.base.save(sharded_state_dict, checkpoint_dir)  # written before training goes on: no copy


def check_nodes_hold(nbytes: int, why: str) -> None:
    """Every rank learns whether each node's available host memory (MemAvailable) holds what its ranks are
    about to copy (``nbytes`` this rank's, for ``why``); where one does not, all stop with one line."""
    rows = [None] * torch.distributed.get_world_size()
    torch.distributed.all_gather_object(rows, (socket.gethostname(), nbytes, meminfo_bytes("MemAvailable")))
    nodes: dict = {}
    for host, wanted, available in rows:
        node = nodes.setdefault(host, {"wanted": 0, "ranks": 0, "available": available})
        node["wanted"] += wanted
        node["ranks"] += 1
    for host, node in nodes.items():
        if node["available"] is not None and node["wanted"] > node["available"]:
            raise UserError(f"--async-save with --offload-params host: {why}, {node['wanted'] / GiB:.2f} GiB on "
                            f"{host} ({node['ranks']} rank(s)), but only {node['available'] / GiB:.2f} GiB of host "
                            f"memory are available there; free host memory (a smaller budget of the host tier) or save "
                            f"without --async-save")


def _finalize_then(finalize_fns, on_written: OnWritten, worker_failure: Callable[[], Optional[str]]):
    """The finalize step: megatron-core's own (collective: every rank runs them, failed or not), then
    ``on_written``; a failure in one line, the worker's own words where it told them (``worker_failure``)."""
    def finalize() -> None:
        failure = None
        try:
            for fn in finalize_fns:
                fn()
        except CheckpointException as err:  # raised on every rank (megatron-core broadcasts it)
            failure = (f"rank {torch.distributed.get_rank()}: the background write failed: "
                       f"{worker_failure() or _one_line(err)}")
        on_written(failure)

    return finalize


def _one_line(err: Exception) -> str:
    return " ".join(str(err).split())[:500]
