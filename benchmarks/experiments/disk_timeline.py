"""The disk, the page cache and the node's cores in short bins after a save, and the tier's quiet spells per
iteration: what beside_writer.py sums per iteration, seen within it (where in a step the writers' bytes went).

    python benchmarks/experiments/disk_timeline.py RUN_LOG DISK_SAMPLES [TRACE] [--after N] [--seconds S] [--bin B]

RUN_LOG: a run's console log, its lines stamped ``[epoch] `` (the determinism experiment's ``determinism_<run>.log``);
DISK_SAMPLES: disk_watch.py's samples of that run (``disk_<run>.txt`` in its raw.tgz); TRACE: its --offload-trace
(``trace_<run>.json``). Time 0 is the end of iteration N (default 4: the save at 4 comes right after it). Each bin
(default 0.6 s, for S seconds, default 12): the disk's read and write GB/s, the page cache's dirty and writeback GB
at its end, the cores busy at nice <= 0 and at nice > 0. With TRACE: the first tier operation after time 0, and per
iteration the share of its time with a tier operation moving data and its gaps of over 20 ms (the quiet spells a
paced writer can use).
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from typing import Dict, List, Sequence, Tuple

ITERATION_END = re.compile(r"^\[(\d+\.\d+)\] .*iteration +(\d+)/")
GAP_S = 0.02  # as tiers.activity.QUIET_S: a pause shorter than this is between two operations


def iteration_ends(lines: Sequence[str]) -> Dict[int, float]:
    """Iteration -> the epoch of its log line."""
    return {int(m.group(2)): float(m.group(1)) for m in map(ITERATION_END.search, lines) if m}


def bins(samples: Sequence[Sequence[float]], start: float, seconds: float, width: float) -> List[Tuple]:
    """(seconds after ``start`` at the bin's end, read GB/s, write GB/s, dirty GB, writeback GB, busy cores,
    niced cores) per bin of about ``width`` seconds, from disk_watch.py's cumulative samples."""
    out, prev = [], None
    for row in samples:
        t = row[0]
        if t < start - width or t > start + seconds:
            continue
        if prev is None or t - prev[0] >= width - 1e-9:
            if prev is not None:
                dt = t - prev[0]
                out.append((t - start, (row[1] - prev[1]) / dt / 1e9, (row[2] - prev[2]) / dt / 1e9, row[3] / 1e9,
                            row[4] / 1e9, (row[5] - prev[5]) / dt, (row[6] - prev[6]) / dt))
            prev = row
    return out


def tier_spans(trace: dict) -> List[List[float]]:
    """The tier's read and write operations, merged where they overlap: [start, end] epochs."""
    events = trace["traceEvents"] if isinstance(trace, dict) else trace
    ops = sorted((e["ts"] / 1e6, (e["ts"] + e["dur"]) / 1e6) for e in events if e.get("name") in ("read", "write"))
    merged: List[List[float]] = []
    for s, e in ops:
        if merged and s <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], e)
        else:
            merged.append([s, e])
    return merged


def quiet_spells(spans: Sequence[Sequence[float]], begin: float, end: float) -> Tuple[float, List[float]]:
    """Of [begin, end): the share with a tier operation moving data, and the gaps between operations of over
    GAP_S that begin in it, longest first."""
    busy = sum(min(e, end) - max(s, begin) for s, e in spans if e > begin and s < end)
    gaps = [spans[i + 1][0] - spans[i][1] for i in range(len(spans) - 1)
            if begin <= spans[i][1] < end and spans[i + 1][0] - spans[i][1] > GAP_S]
    return busy / (end - begin) if end > begin else 0.0, sorted(gaps, reverse=True)


def main(argv: Sequence[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("log")
    parser.add_argument("disk")
    parser.add_argument("trace", nargs="?")
    parser.add_argument("--after", type=int, default=4)
    parser.add_argument("--seconds", type=float, default=12.0)
    parser.add_argument("--bin", type=float, default=0.6)
    args = parser.parse_args(argv)
    with open(args.log) as f:
        ends = iteration_ends(f.readlines())
    if args.after not in ends:
        print(f"{args.log}: no line of iteration {args.after}", file=sys.stderr)
        return 2
    start = ends[args.after]
    with open(args.disk) as f:
        samples = [[float(x) for x in line.split()[:7]] for line in f if line.strip()]
    later_ends = [f"iteration {i} ended at {ends[i] - start:.2f} s" for i in sorted(ends)
                  if start < ends[i] <= start + args.seconds]
    print(f"time 0: the end of iteration {args.after}" + (f"; {', '.join(later_ends)}" if later_ends else ""))
    for t, rd, wr, dirty, wb, busy, niced in bins(samples, start, args.seconds, args.bin):
        print(f"{t:6.2f} s  read {rd:5.2f}  write {wr:5.2f} GB/s  dirty {dirty:5.2f}  writeback {wb:4.2f} GB  "
              f"cores busy {busy:4.1f}, niced {niced:4.1f}")
    if args.trace:
        with open(args.trace) as f:
            spans = tier_spans(json.load(f))
        later = [s for s, _ in spans if s > start + 0.05]
        if later:
            print(f"the first tier operation after time 0 began at {later[0] - start:.2f} s")
        its = sorted(ends)
        for a, b in zip(its, its[1:]):
            share, gaps = quiet_spells(spans, ends[a], ends[b])
            print(f"iteration {b}: {ends[b] - ends[a]:.2f} s, a tier operation moving data {100 * share:.0f}% of it; "
                  f"{len(gaps)} gaps of over {GAP_S * 1e3:.0f} ms: {', '.join(f'{g:.2f}' for g in gaps[:6]) or '-'} s")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
