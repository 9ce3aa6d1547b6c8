"""What forking a process costs it, by the memory it holds: the fork itself (the kernel copies the page tables of
every mapping a child gets), and each page the parent writes while the child lives (a copy-on-write fault: the
page copied, one fault each). For a rank that forks a checkpoint writer at each save: the first cost lands in the
save's hold, the second in the steps while the writer lives. Also what one read of the process's
/proc/self/smaps takes (the kernel walks its page tables, under its memory map lock: what a sample of
experiments/rank_maps.py costs the rank).

    python benchmarks/fork_costs.py [--gib N]

Prints, for N GiB of touched anonymous memory in 4 KiB pages and in transparent huge pages (where the kernel grants
them on request): the fork's time and a read of /proc/self/smaps (least and most of 5 each), then the time to
write a byte of each 4 KiB page again without and with a child alive, and the difference per page.
"""

from __future__ import annotations

import argparse
import mmap
import os
import signal
import sys
import time

PAGE = 4096
FORKS = 5


def touched(nbytes: int, huge: bool) -> mmap.mmap:
    region = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    advice = "MADV_HUGEPAGE" if huge else "MADV_NOHUGEPAGE"
    if hasattr(mmap, advice):
        region.madvise(getattr(mmap, advice))
    write_each_page(region, 1)
    return region


def write_each_page(region: mmap.mmap, value: int) -> float:
    started = time.perf_counter()
    for i in range(0, len(region), PAGE):
        region[i] = value
    return time.perf_counter() - started


def huge_kib() -> int:
    with open("/proc/self/smaps_rollup") as f:
        for line in f:
            if line.startswith("AnonHugePages:"):
                return int(line.split()[1])
    return 0


def fork_seconds() -> list:
    times = []
    for _ in range(FORKS):
        started = time.perf_counter()
        pid = os.fork()
        if pid == 0:
            os._exit(0)
        times.append(time.perf_counter() - started)
        os.waitpid(pid, 0)
    return times


def smaps_read_seconds() -> list:
    times = []
    for _ in range(FORKS):
        started = time.perf_counter()
        with open("/proc/self/smaps") as f:
            f.read()
        times.append(time.perf_counter() - started)
    return times


def copy_on_write_seconds(region: mmap.mmap) -> tuple:
    """(writing each page again, the same with a child alive that shares them)."""
    plain = write_each_page(region, 2)
    pid = os.fork()
    if pid == 0:
        time.sleep(600)
        os._exit(0)
    try:
        shared = write_each_page(region, 3)
    finally:
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
    return plain, shared


def main(argv) -> int:
    parser = argparse.ArgumentParser(prog="fork_costs.py", description=__doc__.split("\n\n")[0])
    parser.add_argument("--gib", type=float, default=1.0, help="GiB of touched memory held at each fork (default 1)")
    args = parser.parse_args(argv[1:])
    nbytes = int(args.gib * (1 << 30)) // PAGE * PAGE
    if nbytes <= 0:
        parser.error(f"--gib {args.gib}: needs at least one 4 KiB page")
    for huge in (False, True):
        region = touched(nbytes, huge)
        huge_mib = huge_kib() >> 10  # before the copies: a huge page written while shared is split and copied
        forks, reads = fork_seconds(), smaps_read_seconds()
        plain, shared = copy_on_write_seconds(region)
        pages = nbytes // PAGE
        print(f"{args.gib:g} GiB in {'huge pages' if huge else '4 KiB pages'} ({huge_mib} MiB of them huge): "
              f"fork {1e3 * min(forks):.1f}-{1e3 * max(forks):.1f} ms; smaps read {1e3 * min(reads):.1f}-"
              f"{1e3 * max(reads):.1f} ms; each page written again {plain:.3f} s, with a "
              f"child sharing them {shared:.3f} s: {1e6 * (shared - plain) / pages:.2f} us a page", flush=True)
        region.close()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
