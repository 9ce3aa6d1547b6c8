"""Samples where the training thread waits, for attributing its voluntary switches (disk_watch.py counts them)
to what it waits on: the GIL and other locks (a futex), the GPU (an ioctl or poll on its device), the process's
memory map lock or a page (rwsem, folio waits), writeback throttling (balance_dirty_pages), until stopped
(SIGTERM).

    python benchmarks/experiments/thread_waits.py OUT_FILE [HZ [WINDOW_S]]

The rank is disk_watch.rank_pid's. Each sample reads the thread's state (/proc/PID/task/PID/stat), its kernel
wait channel (wchan) and its system call (syscall: the number it is blocked in, "running" on a core); a thread
running counts as "R". Each WINDOW_S (default 0.2) one line: the epoch, the samples in the window, then
"KEY=COUNT" for each KEY, "STATE:WCHAN:SYSCALL" (e.g. "S:futex_do_wait:202": a futex wait). Reading these files needs the
rights over the rank a root shell has; without them the keys say "unreadable".
"""

from __future__ import annotations

import sys
import time
from collections import Counter
from typing import Optional

from disk_watch import rank_pid, sample_until_stopped


def read_first(path: str) -> Optional[str]:
    try:
        with open(path) as f:
            return f.read().strip()
    except OSError:
        return None


def wait_key(pid: int, proc: str = "/proc") -> str:
    """Where ``pid``'s main thread is now: "R" on a core or runnable, else "STATE:WCHAN:SYSCALL"."""
    task = f"{proc}/{pid}/task/{pid}"
    stat = read_first(f"{task}/stat")
    if stat is None:
        return "gone"
    state = stat.rsplit(")", 1)[1].split()[0]
    if state == "R":
        return "R"
    wchan = read_first(f"{task}/wchan") or "unreadable"
    syscall = (read_first(f"{task}/syscall") or "unreadable").split()[0]
    return f"{state}:{wchan if wchan != '0' else '-'}:{syscall}"


def main(argv) -> int:
    out = argv[1]
    period = 1.0 / (float(argv[2]) if len(argv) > 2 else 500.0)
    window = float(argv[3]) if len(argv) > 3 else 0.2
    rank, counts, window_end = None, Counter(), time.time() + window

    def sample() -> Optional[str]:  # a line once per window
        nonlocal rank, counts, window_end
        rank = rank or rank_pid()
        if rank is not None:
            counts[wait_key(rank)] += 1
        now = time.time()
        if now < window_end:
            return None
        line = f"{now:.3f} {sum(counts.values())} " + " ".join(f"{k}={n}" for k, n in counts.most_common())
        counts, window_end = Counter(), now + window
        return line

    return sample_until_stopped(out, period, sample)

if __name__ == "__main__":
    sys.exit(main(sys.argv))
