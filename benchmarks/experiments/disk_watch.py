"""Samples the disk under a path, the page cache's dirty bytes and the node's CPU time and page faults until
stopped (SIGTERM), for attributing a run's disk traffic and CPU use to its iterations (beside_writer.py --disk).

    python benchmarks/experiments/disk_watch.py PATH OUT_FILE [INTERVAL_S]

Each line: epoch seconds, bytes read and written by the device so far (its /sys/dev/block stat), the page
cache's Dirty and Writeback bytes (/proc/meminfo), then the node's CPU seconds so far busy at nice <= 0, busy at
nice > 0 (a niced writer's) and in iowait, summed over its cores (/proc/stat), and its page faults so far
(/proc/vmstat pgfault: copy-on-write ones included). Then the training thread's (the rank's main thread: the
process running pretrain_gpt.py whose parent is torchrun, the first seen) seconds on a core and seconds waiting
for one (/proc/PID/task/PID/schedstat), and its voluntary and involuntary context switches (its status): a thread
slowed by cores the writers take waits in the run queue; one slowed by a lock (the GIL) switches voluntarily
more. Then the rank's page faults so far (all its threads: /proc/PID/stat minflt) and those of its descendants
(the live ones' minflt, plus the rank's cminflt: the children it has reaped), then its training thread's own
(/proc/PID/task/PID/stat minflt): which of the node's faults are training's own (copy-on-write of pages a forked
writer shares, fresh memory), which the training thread takes itself, and which are its writers'.
nan until the rank is seen.
"""

from __future__ import annotations

import os
import signal
import sys
import time
from typing import Callable, Dict, List, Optional, Tuple

SECTOR = 512  # the block layer's stat counts 512-byte sectors whatever the device's


def stat_path(path: str) -> str:
    dev = os.stat(path).st_dev
    return f"/sys/dev/block/{os.major(dev)}:{os.minor(dev)}/stat"


def device_bytes(stat_file: str) -> Tuple[int, int]:
    with open(stat_file) as f:
        fields = f.read().split()
    return int(fields[2]) * SECTOR, int(fields[6]) * SECTOR


def page_cache_bytes() -> Tuple[int, int]:
    values = {}
    with open("/proc/meminfo") as f:
        for line in f:
            name, rest = line.split(":", 1)
            if name in ("Dirty", "Writeback"):
                values[name] = int(rest.split()[0]) * 1024
    return values.get("Dirty", 0), values.get("Writeback", 0)


def cpu_seconds() -> Tuple[float, float, float]:
    """(busy at nice <= 0, busy at nice > 0, iowait) seconds over all cores since boot."""
    with open("/proc/stat") as f:
        fields = [int(x) for x in f.readline().split()[1:8]]
    user, nice, system, _idle, iowait, irq, softirq = fields
    tick = os.sysconf("SC_CLK_TCK")
    return (user + system + irq + softirq) / tick, nice / tick, iowait / tick


def page_faults() -> int:
    with open("/proc/vmstat") as f:
        for line in f:
            if line.startswith("pgfault "):
                return int(line.split()[1])
    return 0


def rank_pid(proc: str = "/proc") -> Optional[int]:
    """The training rank's pid: a process running pretrain_gpt.py whose parent runs torchrun (its forked writers
    and data workers have the rank as their parent), the lowest where several; None where none runs yet."""
    cmdlines, parents = {}, {}
    for entry in os.listdir(proc):
        if not entry.isdigit():
            continue
        try:
            with open(f"{proc}/{entry}/cmdline", "rb") as f:
                cmdlines[int(entry)] = f.read()
            with open(f"{proc}/{entry}/stat") as f:
                parents[int(entry)] = int(f.read().rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):
            continue
    ranks = [pid for pid, cmd in cmdlines.items() if b"pretrain_gpt.py" in cmd and b"torchrun" not in cmd
             and b"torchrun" in cmdlines.get(parents.get(pid), b"")]
    return min(ranks) if ranks else None


def _stat_fields(pid: int, proc: str) -> List[str]:
    """/proc/PID/stat's fields after the command's name (which may hold spaces and parentheses): [0] the state,
    [1] the parent's pid, [7] minflt, [8] cminflt."""
    with open(f"{proc}/{pid}/stat") as f:
        return f.read().rsplit(")", 1)[1].split()


def page_faults_of(pid: Optional[int], proc: str = "/proc") -> Tuple[float, float]:
    """(the page faults of ``pid``'s threads, those of its descendants: the live ones' and those it has reaped) so
    far; nan each where ``pid`` cannot be read."""
    nan = float("nan")
    if pid is None:
        return nan, nan
    try:
        own = _stat_fields(pid, proc)
    except (OSError, IndexError):
        return nan, nan
    children: Dict[int, List[int]] = {}
    faults: Dict[int, int] = {}
    for entry in os.listdir(proc):
        if entry.isdigit():
            try:
                fields = _stat_fields(int(entry), proc)
                children.setdefault(int(fields[1]), []).append(int(entry))
                faults[int(entry)] = int(fields[7])
            except (OSError, ValueError, IndexError):
                continue  # gone since the listing
    descendants, todo = 0, list(children.get(pid, []))
    while todo:
        child = todo.pop()
        descendants += faults.get(child, 0)
        todo.extend(children.get(child, []))
    return float(own[7]), float(int(own[8]) + descendants)


def thread_faults(pid: Optional[int], proc: str = "/proc") -> float:
    """The page faults ``pid``'s main thread has taken so far; nan where it cannot be read."""
    if pid is None:
        return float("nan")
    try:
        return float(_stat_fields(pid, f"{proc}/{pid}/task")[7])
    except (OSError, ValueError, IndexError):
        return float("nan")


def thread_schedule(pid: Optional[int], proc: str = "/proc") -> Tuple[float, float, float, float]:
    """(seconds on a core, seconds waiting for one, voluntary switches, involuntary switches) of ``pid``'s main
    thread; nan each where it cannot be read."""
    nan = float("nan")
    if pid is None:
        return nan, nan, nan, nan
    try:
        with open(f"{proc}/{pid}/task/{pid}/schedstat") as f:
            ran_ns, waited_ns = (int(x) for x in f.read().split()[:2])
        switches = {}
        with open(f"{proc}/{pid}/task/{pid}/status") as f:
            for line in f:
                name, _, value = line.partition(":")
                if name in ("voluntary_ctxt_switches", "nonvoluntary_ctxt_switches"):
                    switches[name] = float(value)
    except (OSError, ValueError):
        return nan, nan, nan, nan
    return (ran_ns / 1e9, waited_ns / 1e9, switches.get("voluntary_ctxt_switches", nan),
            switches.get("nonvoluntary_ctxt_switches", nan))


def sample_until_stopped(out: str, interval: float, sample: Callable[[], Optional[str]]) -> int:
    """A sampler's loop (this one's and thread_waits.py's, rank_maps.py's): each line ``sample()`` gives (None:
    nothing this time) written into ``out`` as it comes, every ``interval`` seconds, until SIGTERM, or until the
    sampler's parent is gone: one outliving a killed experiment would write on into the next run's file."""
    stop = []
    signal.signal(signal.SIGTERM, lambda *_: stop.append(True))
    parent = os.getppid()
    with open(out, "w") as f:
        while not stop and os.getppid() == parent:
            line = sample()
            if line is not None:
                f.write(line + "\n")
                f.flush()
            time.sleep(interval)
    return 0


def main(argv) -> int:
    path, out = argv[1], argv[2]
    interval = float(argv[3]) if len(argv) > 3 else 0.2
    stat_file = stat_path(path)
    rank = None

    def sample() -> str:
        nonlocal rank
        read, written = device_bytes(stat_file)
        dirty, writeback = page_cache_bytes()
        busy, niced, iowait = cpu_seconds()
        rank = rank or rank_pid()
        ran, waited, voluntary, involuntary = thread_schedule(rank)
        own, descendants = page_faults_of(rank)
        return (f"{time.time():.3f} {read} {written} {dirty} {writeback} {busy:.2f} {niced:.2f} {iowait:.2f} "
                f"{page_faults()} {ran:.3f} {waited:.3f} {voluntary:.0f} {involuntary:.0f} {own:.0f} "
                f"{descendants:.0f} {thread_faults(rank):.0f}")

    return sample_until_stopped(out, interval, sample)

if __name__ == "__main__":
    sys.exit(main(sys.argv))
