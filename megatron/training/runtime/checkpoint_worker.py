"""--use-persistent-ckpt-worker: torch_dist's files of every --async-save written by one worker process made at
start-up, not by a process forked at each save.

A fork shares the rank's whole memory with the child until the child exits, so each page the training thread
writes meanwhile (the interpreter's heap, the allocators' arenas) is copied on that write: the steps right after a
save pay a fault for each. The standing worker is forked once, before the process group and the model exist, so
that cost falls before the first iteration. Each save copies the tensors it writes into a staging that the rank and
the worker both map (a memfd, pinned for the device's copies where there is one): that copy is the save's
snapshot, as the fork was. The worker gets megatron-core's write function and its buckets over a socket, the
tensors as places in the staging, and runs the write as the forked writer would (checkpoint.async_save's
BackgroundWrite: idle I/O priority, paced flushes); the workers it forks per file are forks of this small process.

    rank -> worker: ("staging", size) + its memfd          the staging (again, grown, where a save needs more)
                    ("write", call, write, args, kwargs, n) + n descriptors (the flush pacing's running lock)
                    ("end",)                                at exit, after the last write
    worker -> rank: ("done", call, None | "one-line failure")

Messages go pickled (multiprocessing.connection) and descriptors as SCM_RIGHTS over one socket pair.
"""

from __future__ import annotations

import mmap
import os
import signal
import socket
import sys
import traceback
from dataclasses import dataclass
from multiprocessing.connection import Connection
from typing import Iterable, List, Optional, Tuple

import torch
from megatron.core.dist_checkpointing.strategies.async_utils import AsyncCaller, AsyncCallsQueue, AsyncRequest


ALIGN = 4096  # each tensor's place in the staging starts on a page
END_WAIT_S = 30.0  # a worker finishing its last write at exit; past this it is killed


@dataclass(frozen=True)
class StagedTensor:
    """Where a tensor of a write bucket lies in the staging."""
    offset: int
    dtype: torch.dtype
    shape: Tuple[int, ...]

    @property
    def nbytes(self) -> int:
        numel = 1
        for n in self.shape:
            numel *= n
        return numel * self.dtype.itemsize


def _aligned(nbytes: int) -> int:
    return -(-nbytes // ALIGN) * ALIGN


def staged_bytes(sizes: Iterable[Tuple[int, torch.dtype]]) -> int:
    """The staging that holds tensors of these (numel, dtype), each on a page of its own."""
    return sum(_aligned(numel * dtype.itemsize) for numel, dtype in sizes)


def bucket_tensors(buckets: list) -> List[torch.Tensor]:
    """The tensors of megatron-core's write buckets (``(path, storage key, (bytes items, tensor items))``)."""
    return [tensor for _, _, (_, tensor_items) in buckets for _, tensor in tensor_items]


class SharedStaging:
    """Host memory the rank writes each save's tensors into and the worker reads them from (a memfd both map).
    It only grows; made full-sized at start-up (``reserve``), it is made again only by a save that needs more."""

    def __init__(self, pin: bool):
        self.pin = pin  # registered with CUDA: the device's copies into it run at the link's pace
        self.size = 0
        self.fd: Optional[int] = None
        self.mapping: Optional[mmap.mmap] = None
        self.flat: Optional[torch.Tensor] = None

    def reserve(self, nbytes: int) -> bool:
        """At least ``nbytes``, its pages in memory; True where it was made anew (the worker must map it again)."""
        if nbytes <= self.size:
            return False
        self.close()
        self.fd = os.memfd_create("mlp_offload_torch_dist_staging", os.MFD_CLOEXEC)
        os.ftruncate(self.fd, nbytes)
        self.mapping = mmap.mmap(self.fd, nbytes)
        self.flat = torch.frombuffer(self.mapping, dtype=torch.uint8)
        self.flat.zero_()  # its pages now, not while a save holds training
        if self.pin:
            torch.cuda.cudart().cudaHostRegister(self.flat.data_ptr(), nbytes, 0)
        self.size = nbytes
        return True

    def stage(self, buckets: list) -> list:
        """The buckets with each tensor copied into the staging and replaced by its place (StagedTensor)."""
        self.reserve(staged_bytes((t.numel(), t.dtype) for t in bucket_tensors(buckets)))
        staged, offset = [], 0
        for path, key, (bytes_items, tensor_items) in buckets:
            placed = []
            for item, tensor in tensor_items:
                nbytes = tensor.numel() * tensor.element_size()
                if nbytes:
                    target = self.flat[offset:offset + nbytes].view(tensor.dtype).view(tensor.shape)
                    target.copy_(tensor, non_blocking=self.pin and tensor.is_cuda)
                placed.append((item, StagedTensor(offset, tensor.dtype, tuple(tensor.shape))))
                offset += _aligned(nbytes)
            staged.append((path, key, (bytes_items, placed)))
        if self.pin:
            torch.cuda.synchronize()
        return staged

    def close(self) -> None:
        if self.flat is not None and self.pin:
            torch.cuda.cudart().cudaHostUnregister(self.flat.data_ptr())
        self.flat = None
        if self.mapping is not None:
            try:
                self.mapping.close()
            except BufferError:  # a tensor of a save still views it: the mapping goes with the last of them
                pass
            self.mapping = None
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None
        self.size = 0


def unstaged(buckets: list, mapped: mmap.mmap) -> list:
    """The worker's side of ``SharedStaging.stage``: each place a tensor of its own over the mapping (its storage
    exactly its bytes, as torch.save writes a tensor's whole storage)."""
    out = []
    for path, key, (bytes_items, placed) in buckets:
        tensors = [(item, torch.frombuffer(mapped, dtype=p.dtype, count=p.nbytes // p.dtype.itemsize,
                                           offset=p.offset).view(p.shape) if p.nbytes else
                    torch.empty(p.shape, dtype=p.dtype)) for item, p in placed]
        out.append((path, key, (bytes_items, tensors)))
    return out


class StandingWorker:
    """The rank's end of the worker: made by ``start`` (a fork) before the process group and the model exist."""

    def __init__(self, pid: int, sock: socket.socket, pin: bool):
        self.pid = pid
        self._sock = sock  # the descriptors go over it
        self._conn = Connection(os.dup(sock.fileno()))  # the messages, pickled, over the same socket
        self.staging = SharedStaging(pin)
        self._sent_size = 0  # the staging the worker maps
        self._done: dict = {}  # call -> failure (None: written)

    @classmethod
    def start(cls, pin: bool) -> "StandingWorker":
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        sys.stdout.flush()
        sys.stderr.flush()
        parent_pid = os.getpid()
        # ^C to the job is the rank's to handle: held back across the fork, so the worker ignores it before any
        # can reach it, and the rank gets one that came meanwhile once unblocked
        blocked = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})
        pid = os.fork()
        if pid == 0:  # the worker: it never returns
            code = 0
            try:
                signal.signal(signal.SIGINT, signal.SIG_IGN)
                signal.pthread_sigmask(signal.SIG_SETMASK, blocked)
                ours.close()
                _serve(theirs, parent_pid)
            except BaseException:  # noqa: BLE001 - the worker's end, told on its stderr
                traceback.print_exc()
                code = 1
            finally:
                os._exit(code)
        signal.pthread_sigmask(signal.SIG_SETMASK, blocked)
        theirs.close()
        return cls(pid, ours, pin)

    def reserve(self, nbytes: int) -> None:
        """The staging made at least ``nbytes`` now (at start-up), and the worker told."""
        self.staging.reserve(nbytes)
        self._share_staging()

    def submit(self, call: int, write, args: list, kwargs: dict, lock_fd: Optional[int]) -> None:
        """Stage the tensors of ``args[1]`` (megatron-core's write buckets) and have the worker run ``write``."""
        args = list(args)
        args[1] = self.staging.stage(args[1])
        self._share_staging()
        fds = [] if lock_fd is None else [lock_fd]
        self._conn.send(("write", call, write, args, kwargs or {}, len(fds)))
        if fds:
            socket.send_fds(self._sock, [b"F"], fds)

    def result(self, call: int, wait: bool) -> Tuple[bool, Optional[str]]:
        """(whether ``call``'s write has ended, its failure); with ``wait``, once it has."""
        while call not in self._done:
            if not wait and not self._conn.poll(0):
                return False, None
            try:
                frame = self._conn.recv()
            except (EOFError, OSError):  # it ended; killed with our messages unread, its end was reset
                frame = None
            if frame is None:
                self._done[call] = f"the checkpoint worker (pid {self.pid}) ended before the write did"
                break
            _, done_call, failure = frame
            self._done[done_call] = failure
        return True, self._done.pop(call)

    def kill(self) -> None:
        """The run is failing: the worker stops where it is."""
        try:
            os.kill(self.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self._reap(None)

    def close(self) -> None:
        """At exit: the worker ends once its socket closes (after the write it has, if any)."""
        try:
            self._conn.send(("end",))  # not the socket's close alone: a process the rank forked since holds it too
        except OSError:
            pass
        self._conn.close()
        self._sock.close()
        self._reap(END_WAIT_S)
        self.staging.close()

    def _reap(self, timeout: Optional[float]) -> None:
        import time
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            try:
                pid, _ = os.waitpid(self.pid, os.WNOHANG)
            except ChildProcessError:
                return
            if pid:
                return
            if deadline is not None and time.monotonic() > deadline:
                os.kill(self.pid, signal.SIGKILL)
                deadline = None
            time.sleep(0.05)

    def _share_staging(self) -> None:
        if self.staging.size != self._sent_size:
            self._conn.send(("staging", self.staging.size))
            socket.send_fds(self._sock, [b"F"], [self.staging.fd])
            self._sent_size = self.staging.size


def _serve(sock: socket.socket, parent_pid: int) -> None:
    """The worker's loop: map the staging, run each write, say how it ended; out once the rank's end closes."""
    from megatron.training.runtime.die_with_parent import die_with_parent
    die_with_parent(parent_pid=parent_pid)
    conn = Connection(os.dup(sock.fileno()))
    mapped: Optional[mmap.mmap] = None
    while True:
        try:
            frame = conn.recv()
        except EOFError:
            return
        if frame[0] == "end":
            return
        if frame[0] == "staging":
            fd = _receive_fds(sock, 1)[0]
            mapped = mmap.mmap(fd, frame[1])
            os.close(fd)
            continue
        _, call, write, args, kwargs, nfds = frame
        fds = _receive_fds(sock, nfds)
        failure = None
        try:
            args[1] = unstaged(args[1], mapped)
            write(*args, **kwargs)
        except Exception as err:  # noqa: BLE001 - told to the rank, which fails the save in one line
            traceback.print_exc()
            failure = " ".join(f"{type(err).__name__}: {err}".split())[:500]
        finally:
            for fd in fds:
                os.close(fd)  # the flush pacing's running lock: this write has ended
        try:
            conn.send(("done", call, failure))
        except OSError:  # the rank has closed its end (at exit) or died: nothing left to tell
            return


def _receive_fds(sock: socket.socket, count: int) -> List[int]:
    if not count:
        return []
    _, fds, _, _ = socket.recv_fds(sock, 1, count)
    return list(fds)


class StandingCaller(AsyncCaller):
    """megatron-core's async caller for one save, run by the standing worker instead of a fork."""

    def __init__(self, worker: StandingWorker):
        self.worker = worker
        self.call: Optional[int] = None
        self.failure: Optional[str] = None

    def schedule_async_call(self, async_req: AsyncRequest) -> None:
        if async_req.async_fn is None:
            return
        self.call = async_req.call_idx
        flush = getattr(async_req.async_fn, "flush", None)
        lock_fd = flush.running_lock() if flush is not None else None
        try:
            self.worker.submit(self.call, async_req.async_fn, async_req.async_fn_args, async_req.async_fn_kwargs,
                               lock_fd)
        finally:
            if lock_fd is not None:
                os.close(lock_fd)  # the worker's copy holds the lock until its write ends

    def is_current_async_call_done(self, blocking: bool = False, no_dist: bool = False) -> bool:
        ended = True
        if self.call is not None:
            ended, self.failure = self.worker.result(self.call, wait=blocking)
            if ended:
                self.call = None  # told once by the worker; its failure stays
        is_done = ended if no_dist else self.sync_all_async_calls(int(not ended))
        return bool(is_done) or blocking

    def close(self, abort: bool = False) -> None:
        if abort:
            self.worker.kill()

    def __del__(self):
        pass


class StandingQueue(AsyncCallsQueue):
    """megatron-core's queue of async calls, each run by the standing worker."""

    def __init__(self, worker: StandingWorker):
        super().__init__(persistent=False)
        self.worker = worker

    def _get_async_caller(self):
        return StandingCaller(self.worker)
