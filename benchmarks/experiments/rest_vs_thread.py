"""What the steps beside the writer lose outside their update, against their training thread's own work, over many
readings of beside_writer.py.

    python benchmarks/experiments/rest_vs_thread.py docs/results/*/*/determinism_beside_writer_*.txt

For each step beside the writer: its extra seconds outside the update ("rest", mostly the forward and backward) over
the same step of the run without saves, against its training thread's extra voluntary context switches there (each a
wait: for the interpreter's lock handed between threads, a device sync, a page) and its extra seconds on a core.
Then Pearson's r and Spearman's rank correlation of each with the extra rest, and the mean extra rest by quarter of
the switches: whether the writer's threads in the rank's process cost the forward and backward through those
hand-overs, or the training thread's own extra work does. Read twice: over every step, and without the first step
after a save (the fork of torch_dist's writer and the copy aside are in that one alone). Last, where the outputs
hold the disk's bytes per phase: the extra rest of the steps whose forward and backward took at least
``WRITTEN_GB`` of the writers' bytes, by their place after the save: the first (torch_dist's forked writer, a
process of its own, writes in it), the second (it ends, the offloaded state's writer begins) and the later ones
(the offloaded state's writer alone: threads of the rank's process until 0ffaf9c, then its CRCs and writes by a
helper process, the copies into its ring still by the rank).
"""

from __future__ import annotations

import re
import sys
from typing import Dict, List, Optional, Tuple

import numpy as np

from first_step_copy import correlations  # this script's directory, as when run beside it

REST = re.compile(r"^iteration (\d+): [0-9.]+ s beside .*?rest ([0-9.]+)\), [0-9.]+ s without saves "
                  r"\(update [0-9.]+ \+ rest ([0-9.]+)\)", re.M)
DISK = re.compile(r"iteration (\d+)'s disk in its forward and backward: read [0-9.]+ GB, wrote ([0-9.]+) GB; .*?"
                  r"\(without saves: [0-9.]+, ([0-9.]+);")
WRITTEN_GB = (1.0, 2.0)  # the least extra GB written in a forward and backward for the last reading
THREAD = re.compile(r"iteration (\d+)'s training thread in its forward and backward: (\d+) voluntary switches, "
                    r"([0-9.]+) s on a core; in its update: \d+, [0-9.]+ s \(without saves: (\d+), ([0-9.]+) s")


def readings(text: str) -> List[Tuple[int, float, float, int, Optional[float]]]:
    """(extra switches, extra s on a core, extra rest s, its place after the save (1: the first step), extra GB
    written in its forward and backward or None) of each step of one beside_writer.py output with the first three."""
    rest: Dict[int, float] = {int(m[0]): float(m[1]) - float(m[2]) for m in REST.findall(text)}
    written: Dict[int, float] = {int(m[0]): float(m[1]) - float(m[2]) for m in DISK.findall(text)}
    first = min(rest, default=None)
    rows = []
    for it, switches, core, plain_switches, plain_core in THREAD.findall(text):
        if int(it) in rest:
            rows.append((int(switches) - int(plain_switches), float(core) - float(plain_core), rest[int(it)],
                         int(it) - first + 1, written.get(int(it))))
    return rows


def by_writer(rows: List[Tuple[int, float, float, int, Optional[float]]]) -> None:
    """The extra rest of the steps that took at least each of ``WRITTEN_GB`` into their forward and backward, by
    their place after the save: the first (torch_dist's forked writer), the second (it, then the offloaded state's
    writer), the later ones (the offloaded state's writer alone)."""
    places = ((lambda k: k == 1, "the first step after the save (torch_dist's forked writer, a process of its own)"),
              (lambda k: k == 2, "the second (that writer, then the offloaded state's)"),
              (lambda k: k >= 3, "later steps (the offloaded state's writer alone)"))
    for least in WRITTEN_GB:
        for place, who in places:
            rest = [row[2] for row in rows if place(row[3]) and row[4] is not None and row[4] >= least]
            listed = ", ".join(f"{r:.2f}" for r in rest)
            mean = f": extra rest {np.mean(rest):.2f} s on average ({listed})" if rest else ""
            print(f"  >= {least:.1f} GB written in the forward and backward, {who}: {len(rest)} steps{mean}")


def summary(rows: List[Tuple[int, float, float, int, Optional[float]]], what: str) -> None:
    switches, core, rest = (np.array(c, dtype=float) for c in list(zip(*rows))[:3])
    print(f"{what}: {len(rows)} steps")
    for name, values in (("extra voluntary switches", switches), ("extra s on a core", core)):
        c = correlations(values, rest)
        print(f"  {name} against the extra rest: Pearson r {c['pearson']:.2f}, Spearman {c['spearman']:.2f}")
    order = np.argsort(switches, kind="stable")
    for quarter in np.array_split(order, 4):
        print(f"  switches {switches[quarter].min():.0f} to {switches[quarter].max():.0f}: extra rest "
              f"{rest[quarter].mean():.2f} s on average ({len(quarter)} steps)")


def main(paths: List[str]) -> int:
    rows = []
    for path in paths:
        with open(path) as f:
            rows += readings(f.read())
    if len(rows) < 4:
        print(f"{len(rows)} steps read: too few to correlate")
        return 1
    print(f"steps beside the writer, from {len(paths)} files")
    summary(rows, "every step")
    later = [row for row in rows if row[3] > 1]
    if len(later) >= 4:
        summary(later, "without the first step after each save")
    if any(row[4] is not None for row in rows):
        print("by the writer in the forward and backward")
        by_writer(rows)
    return 0


if __name__ == "__main__":
    if len(sys.argv) < 2:
        sys.exit(__doc__)
    sys.exit(main(sys.argv[1:]))
