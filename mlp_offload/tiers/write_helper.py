"""A checkpoint writer's CRCs and writes, made by a process of their own beside the rank.

Threads of the training process that take CRCs and issue writes slow the training thread's steps even
though each leaves the interpreter's lock while it works: a process of its own doing the same work beside
the same steps slowed them less (docs/benchmarks.md has the measurement). So ``DirectRegionWriter`` copies
each piece into a staging ring the rank shares with this helper (a memfd, mapped by both), and the helper
chains the CRC32s and writes the pieces with threads of its own. The rank keeps the copies: only it can
read its own memory and the device's.

The helper is this file run by the interpreter in isolated mode (``python -I -S``): the standard library
only, no torch, started in tens of milliseconds for each file written. It talks over a socket pair, in
length-prefixed pickled tuples; the descriptors (the ring, the file, the file opened with O_DIRECT) are
passed over the socket (SCM_RIGHTS). Once the rank says so, or its end of the socket closes (the rank died), the
helper finishes the writes it was given and exits: the word, not the socket's end, because a child the rank forks
meanwhile holds a copy of that end.

    rank -> helper: ("piece", k, [(slot, lo, hi)], [(which, lo, hi, file_offset)])   CRC ranges, writes
                    ("crcs", request, [slot, ...])                                    the chained CRCs
                    ("end",)                                                          the writes given, then exit
    helper -> rank: ("ready",)                        it has the descriptors and the ring
                    ("done", k)                       piece k's CRCs and writes are done: its buffer is free
                    ("crcs", request, [crc, ...])     after every CRC range sent before the request
                    ("failed", errno, message)        a write or a CRC failed (errno 0: not an OSError)

``lo``/``hi`` are byte offsets in the ring; ``which`` picks the file descriptor (0: through the page cache,
1: O_DIRECT); a slot is one tensor's chained CRC32, started at 0 and dropped once asked for.
"""

from __future__ import annotations

import mmap
import os
import pickle
import signal
import socket
import struct
import subprocess
import sys
import threading
import zlib
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Dict, List, Optional, Sequence, Set, Tuple

LENGTH = struct.Struct("<I")
END_WAIT_S = 120.0  # a helper draining its last pieces to a slow disk; past this it is killed
START_WAIT_S = 60.0  # an interpreter starting on a node whose cores and file system are busy


def send_frame(sock: socket.socket, message: tuple) -> None:
    data = pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)
    sock.sendall(LENGTH.pack(len(data)) + data)


def receive_frame(sock: socket.socket) -> Optional[tuple]:
    """The next message, or None once the other end has closed."""
    head = _receive_exactly(sock, LENGTH.size)
    if head is None:
        return None
    body = _receive_exactly(sock, LENGTH.unpack(head)[0])
    return None if body is None else pickle.loads(body)


def _receive_exactly(sock: socket.socket, nbytes: int) -> Optional[bytes]:
    parts, left = [], nbytes
    while left:
        part = sock.recv(left)
        if not part:
            return None
        parts.append(part)
        left -= len(part)
    return b"".join(parts)


def pwrite_all(fd: int, data, offset: int) -> None:
    data = memoryview(data)
    while len(data):
        n = os.pwrite(fd, data, offset)
        data, offset = data[n:], offset + n


class _Helper:
    """The helper's side: a piece's CRC ranges go to one thread (in the order sent: they chain), its writes
    to a pool; the reply goes out once all of them are done."""

    def __init__(self, sock: socket.socket, ring: memoryview, fds: Sequence[int], threads: int):
        self.sock, self.ring, self.fds = sock, ring, fds
        self.crc_thread = ThreadPoolExecutor(1)
        self.writes = ThreadPoolExecutor(threads)
        self.crcs: Dict[int, int] = {}
        self.sending = threading.Lock()
        self.failing = threading.Lock()
        self.failed = False

    def send(self, message: tuple) -> None:
        with self.sending:
            try:
                send_frame(self.sock, message)
            except OSError:  # the rank closed its end (its save failed or was cancelled): nobody to tell
                pass

    def piece(self, k: int, crc_ranges, writes) -> None:
        futures = [self.crc_thread.submit(self._chain, slot, lo, hi) for slot, lo, hi in crc_ranges]
        futures += [self.writes.submit(pwrite_all, self.fds[which], self.ring[lo: hi], offset)
                    for which, lo, hi, offset in writes]
        left, counting = [len(futures)], threading.Lock()

        def one_done(_: Future) -> None:
            with counting:
                left[0] -= 1
                if left[0]:
                    return
            errors = [f.exception() for f in futures if f.exception() is not None]
            if errors:
                self.fail(errors[0])
            else:
                self.send(("done", k))
        for future in futures:
            future.add_done_callback(one_done)

    def _chain(self, slot: int, lo: int, hi: int) -> None:
        self.crcs[slot] = zlib.crc32(self.ring[lo: hi], self.crcs.get(slot, 0))

    def answer_crcs(self, request: int, slots: List[int]) -> None:
        def answer() -> None:  # on the CRC thread: after every range sent before it
            self.send(("crcs", request, [self.crcs.pop(slot, 0) for slot in slots]))
        self.crc_thread.submit(answer)

    def fail(self, err: BaseException) -> None:
        with self.failing:  # pieces end on several threads: the first failure alone is the one the rank raises
            first, self.failed = not self.failed, True
        if first:
            self.send(("failed", getattr(err, "errno", 0) or 0, str(err)))

    def drain(self) -> None:
        self.writes.shutdown(wait=True)
        self.crc_thread.shutdown(wait=True)


def serve(sock: socket.socket) -> None:
    """The helper's loop: the descriptors first, then commands until ("end",) or the rank's end closes."""
    message, fds, _, _ = socket.recv_fds(sock, 4096, 3)
    if not message or len(fds) != 3:  # the rank failed or died before it could send them
        return
    ring_bytes, threads, has_direct = pickle.loads(message)
    region = mmap.mmap(fds[0], ring_bytes, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ)
    os.close(fds[0])
    helper = _Helper(sock, memoryview(region), [fds[1], fds[2] if has_direct else fds[1]], threads)
    helper.send(("ready",))
    try:
        while True:
            command = receive_frame(sock)
            if command is None or command[0] == "end":  # the writer is closed, or the rank is gone
                return
            if command[0] == "piece":
                helper.piece(*command[1:])
            elif command[0] == "crcs":
                helper.answer_crcs(*command[1:])
    finally:
        helper.drain()


class HelperFailed(RuntimeError):
    """The write helper ended without being asked to (killed, out of memory)."""


class WriteHelper:
    """The rank's side: ``start`` spawns the helper with a file's descriptors and the shared ring; ``piece``
    hands it a piece's CRC ranges and writes; ``wait_done(k)`` returns once piece ``k``'s buffer is free;
    ``crcs(slots)`` gives the chained CRCs (after every piece sent before); ``close()`` ends the helper once
    it has made the writes it was given. A write's failure is raised by ``wait_done`` or ``crcs`` as the
    OSError it was (its errno kept: a full disk stays ENOSPC)."""

    def __init__(self, process: subprocess.Popen, sock: socket.socket):
        self.process, self.sock = process, sock
        self.done: Set[int] = set()
        self.answers: Dict[int, list] = {}
        self.requests = 0
        self.closed = False

    @classmethod
    def start(cls, ring_fd: int, ring_bytes: int, fd: int, direct: Optional[int], threads: int) -> "WriteHelper":
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            process = subprocess.Popen([sys.executable, "-I", "-S", os.path.abspath(__file__), str(theirs.fileno())],
                                       pass_fds=[theirs.fileno()], stdin=subprocess.DEVNULL)
        except BaseException:
            ours.close()
            raise
        finally:
            theirs.close()
        helper = cls(process, ours)
        try:
            fds = [ring_fd, fd, direct if direct is not None else fd]
            socket.send_fds(ours, [pickle.dumps((ring_bytes, threads, direct is not None))], fds)
            ours.settimeout(START_WAIT_S)
            ready = receive_frame(ours)
            ours.settimeout(None)
        except (OSError, EOFError) as err:  # a timeout is an OSError
            raise _not_started(helper, err) from err
        except BaseException:
            helper.close()
            raise
        if ready != ("ready",):
            raise _not_started(helper, None)
        return helper

    def piece(self, k: int, crc_ranges: List[Tuple[int, int, int]], writes: List[Tuple[int, int, int, int]]) -> None:
        self._send(("piece", k, crc_ranges, writes))

    def wait_done(self, k: int) -> None:
        while k not in self.done:
            self._receive()
        self.done.discard(k)

    def crcs(self, slots: List[int]) -> List[int]:
        self.requests += 1
        request = self.requests
        self._send(("crcs", request, slots))
        while request not in self.answers:
            self._receive()
        return self.answers.pop(request)

    def close(self) -> None:
        """Close the connection and wait for the helper to exit: it makes the writes it was given first (a
        failed or cancelled save's file is removed by its caller either way). Raises nothing."""
        if self.closed:
            return
        self.closed = True
        try:
            send_frame(self.sock, ("end",))
        except OSError:  # it is gone already
            pass
        self.sock.close()
        try:
            self.process.wait(END_WAIT_S)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()

    def _send(self, message: tuple) -> None:
        try:
            send_frame(self.sock, message)
        except OSError as err:
            raise self._gone() from err

    def _receive(self) -> None:
        try:
            message = receive_frame(self.sock)
        except OSError as err:  # reset: the helper died with our commands unread
            raise self._gone() from err
        if message is None:
            raise self._gone()
        kind = message[0]
        if kind == "done":
            self.done.add(message[1])
        elif kind == "crcs":
            self.answers[message[1]] = message[2]
        elif kind == "failed":
            errno, text = message[1], message[2]
            raise OSError(errno, os.strerror(errno)) if errno else RuntimeError(f"checkpoint write helper: {text}")

    def _gone(self) -> HelperFailed:
        code = self.process.poll()
        return HelperFailed(f"the checkpoint write helper (pid {self.process.pid}) ended "
                            f"{'with exit code ' + str(code) if code is not None else 'its connection'} "
                            "before its writes were done")


def _not_started(helper: WriteHelper, err: Optional[BaseException]) -> OSError:
    """The error of a helper that did not start, ended: its exit code where it exited, else ``err``."""
    if isinstance(err, TimeoutError):
        helper.process.kill()  # still starting: nothing of ours to finish
    helper.close()
    code = helper.process.returncode
    return OSError(f"it did not start: {f'exit code {code}' if code or err is None else err}")


def shared_ring(nbytes: int) -> Tuple[int, mmap.mmap]:
    """A memfd of ``nbytes`` mapped shared, which forked children of the rank do not inherit; its descriptor
    (for the helper; the caller closes it once sent) and the mapping."""
    fd = os.memfd_create("mlp-offload-ckpt-ring", os.MFD_CLOEXEC)
    try:
        os.ftruncate(fd, nbytes)
        region = mmap.mmap(fd, nbytes, flags=mmap.MAP_SHARED)
        region.madvise(mmap.MADV_DONTFORK)
    except BaseException:
        os.close(fd)
        raise
    return fd, region


if __name__ == "__main__":
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # a Ctrl-C reaches the whole job: the rank decides, and ends us
    serve(socket.socket(fileno=int(sys.argv[1])))
