"""Samples the training rank's memory by kind of mapping, private and shared dirty bytes apart, until stopped
(SIGTERM): which of the rank's pages a forked writer's lifetime makes it copy (a page the rank writes while a
child shares it turns from shared to private, one copy-on-write fault each) and which memory is new.

    python benchmarks/experiments/rank_maps.py OUT_FILE [INTERVAL_S]   (default 2)

The rank is disk_watch.rank_pid's. Each sample reads its /proc/PID/smaps once (the kernel walks its page tables
for it, under the rank's memory map lock taken for reading, which the rank's own mappings and unmappings wait for;
benchmarks/fork_costs.py times such a read by the memory held: hence a sample every 2 s by default) and writes one line: the epoch, then for each kind ``KIND=RSS,PRIVATE_DIRTY,SHARED_DIRTY`` in KiB. The kinds: "heap" (the C
heap, where Python's small objects and glibc's smaller blocks live), "anon" (anonymous mappings: larger blocks,
torch's host tensors, the runtime's arenas), "stack", "file" (file-backed: libraries' data, mapped files),
"shmem" (/dev/shm, memfd, SysV shared memory), "other" ([vvar], [vdso] and the like).
"""

from __future__ import annotations

import sys
import time
from collections import defaultdict
from typing import Dict, List, Optional

from disk_watch import rank_pid, sample_until_stopped

FIELDS = {"Rss": 0, "Private_Dirty": 1, "Shared_Dirty": 2}
KINDS = ("heap", "anon", "stack", "file", "shmem", "other")


def kind_of(header: str) -> str:
    """The kind of the mapping whose smaps header line (``START-END PERMS OFFSET DEV INODE [PATH]``) is given."""
    parts = header.split(None, 5)
    path = parts[5].strip() if len(parts) > 5 else ""
    if not path:
        return "anon"
    if path == "[heap]":
        return "heap"
    if path.startswith("[stack"):
        return "stack"
    if path.startswith(("/dev/shm/", "/memfd:", "/SYSV")) or path.startswith("/dev/zero"):
        return "shmem"
    if path.startswith("["):
        return "other"
    return "file"


def by_kind(smaps_text: str) -> Dict[str, List[int]]:
    """KIND -> [RSS, private dirty, shared dirty] in KiB, summed over the mappings of /proc/PID/smaps' text."""
    sums: Dict[str, List[int]] = defaultdict(lambda: [0, 0, 0])
    kind = None
    for line in smaps_text.splitlines():
        first, _, rest = line.partition(" ")
        if not first.endswith(":"):  # a mapping's header: its address range first
            kind = kind_of(line)
        elif first[:-1] in FIELDS and kind is not None:
            sums[kind][FIELDS[first[:-1]]] += int(rest.split()[0])
    return dict(sums)


def sample_line(when: float, sums: Dict[str, List[int]]) -> str:
    return f"{when:.3f} " + " ".join(f"{k}={','.join(str(v) for v in sums.get(k, [0, 0, 0]))}" for k in KINDS)


def parse_line(line: str) -> Optional[tuple]:
    """(epoch, {kind: (RSS, private dirty, shared dirty) KiB}) from a sample line; None for a blank one."""
    fields = line.split()
    if not fields:
        return None
    out = {}
    for field in fields[1:]:
        kind, _, values = field.partition("=")
        out[kind] = tuple(int(v) for v in values.split(","))
    return float(fields[0]), out


def read_smaps(pid: int, proc: str = "/proc") -> Optional[str]:
    try:
        with open(f"{proc}/{pid}/smaps") as f:
            return f.read()
    except OSError:
        return None


def main(argv) -> int:
    out = argv[1]
    interval = float(argv[2]) if len(argv) > 2 else 2.0
    rank = None

    def sample() -> Optional[str]:
        nonlocal rank
        rank = rank or rank_pid()
        text = read_smaps(rank) if rank is not None else None
        return sample_line(time.time(), by_kind(text)) if text is not None else None

    return sample_until_stopped(out, interval, sample)

if __name__ == "__main__":
    sys.exit(main(sys.argv))
