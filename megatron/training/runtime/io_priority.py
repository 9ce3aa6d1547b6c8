"""The idle I/O priority class (Linux ``ioprio_set``) and the lowest CPU priority (nice 19) for megatron-core's
torch_dist writer process.

With --async-save, megatron-core forks a process per save that writes the torch_dist files; nothing of
ours runs inside its writes, so it cannot be paced like the offloaded state's writer
(mlp_offload.checkpoint.pacing). What can be done from our side is the function the fork runs: wrapped
by ``at_idle_priority``, the child first puts itself in the idle class (inherited by the processes
and threads it starts), so a scheduler that serves classes lets the file tiers' I/O go first. It also
takes nice 19: the writer forks a worker per file (up to 8), each copying its file into the page cache at
full speed, on the cores where the rank's update runs parallel regions that wait for their slowest thread;
at nice 19 those workers take the cores the training leaves idle (the kernel's weights, 15 for nice 19
against 1024 for nice 0, leave them about 1.5% of a core where a training thread wants it).

Only some block schedulers honour it: ``bfq`` (fully) and ``mq-deadline`` (it orders by class); ``none``
(the usual one of NVMe drives) and ``kyber`` ignore it. And writes that go through the page cache are
written back by the kernel's flusher threads at their own priority; only O_DIRECT writes and what the
writer's own fsync issues carry the class. ``scheduler_of`` names the device's, for the log line.
"""

from __future__ import annotations

import ctypes
import functools
import os
import platform
from typing import Callable, Optional

IOPRIO_WHO_PROCESS = 1  # with who = 0: the calling thread (the forked child's only thread at its start)
IOPRIO_CLASS_IDLE = 3
IOPRIO_CLASS_SHIFT = 13
SYSCALLS = {"x86_64": (251, 252), "aarch64": (30, 31), "ppc64le": (273, 274)}  # (ioprio_set, ioprio_get)
HONOURED_BY = ("bfq", "mq-deadline")


def _syscall(index: int, *args: int) -> int:
    numbers = SYSCALLS.get(platform.machine())
    if numbers is None or not hasattr(os, "sched_getaffinity"):  # Linux only
        return -1
    libc = ctypes.CDLL(None, use_errno=True)
    return libc.syscall(numbers[index], *args)


def set_idle_io_priority() -> bool:
    """Put the calling thread (and what it starts later) in the idle I/O class; whether the kernel took it."""
    return _syscall(0, IOPRIO_WHO_PROCESS, 0, IOPRIO_CLASS_IDLE << IOPRIO_CLASS_SHIFT) == 0


def io_priority_class() -> int:
    """The calling thread's I/O class (0: none set, which is best-effort; 3: idle), -1 where unknown."""
    value = _syscall(1, IOPRIO_WHO_PROCESS, 0)
    return value >> IOPRIO_CLASS_SHIFT if value >= 0 else -1


LOWEST_NICE = 19


def set_lowest_cpu_priority() -> bool:
    """Give the calling thread (and what it starts later) the lowest CPU priority; whether it took."""
    try:
        os.setpriority(os.PRIO_PROCESS, 0, LOWEST_NICE)  # Linux: the calling thread, inherited by what it starts
    except (OSError, AttributeError):
        return False
    return True


def at_idle_priority(fn: Callable) -> Callable:
    """``fn`` run in the idle I/O class and at nice 19 (for a forked writer: the child's, not the rank's).
    A kernel that refuses either leaves the write as it was."""
    @functools.wraps(fn)
    def run(*args, **kwargs):
        set_idle_io_priority()
        set_lowest_cpu_priority()
        return fn(*args, **kwargs)

    return run


def scheduler_of(path: str) -> Optional[str]:
    """The block scheduler in use (``[name]`` in sysfs) of the device holding ``path``, None where unknown
    (no sysfs, a file system without a block device: tmpfs, overlay, network)."""
    dev = os.stat(path).st_dev
    base = f"/sys/dev/block/{os.major(dev)}:{os.minor(dev)}"
    for candidate in (f"{base}/queue/scheduler", f"{base}/../queue/scheduler"):  # a partition: its disk's
        try:
            with open(candidate) as f:
                text = f.read()
        except OSError:
            continue
        if "[" in text:
            return text[text.index("[") + 1:text.index("]")]
    return None


def describe(path: str) -> str:
    """How far the idle class goes for writes into ``path``, for the save's log line."""
    scheduler = scheduler_of(path)
    if scheduler is None:
        return "its device's scheduler unknown (not a block device here): it may not be honoured"
    if scheduler in HONOURED_BY:
        return f"honoured by the device's {scheduler} scheduler for its direct writes and fsyncs"
    return f"NOT honoured: the device's scheduler is {scheduler}"
