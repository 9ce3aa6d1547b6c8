"""The iterations that ran beside an --async-save writer against the same iterations of a run without saves
(issue 49 item 4's goal: at most 1.25x), from two console logs, with the save's pacing lines.

    python benchmarks/experiments/beside_writer.py ASYNC_LOG PLAIN_LOG [--disk ASYNC_DISK PLAIN_DISK]
        [--trace ASYNC_TRACE PLAIN_TRACE] [--waits ASYNC_WAITS PLAIN_WAITS] [--maps ASYNC_MAPS PLAIN_MAPS]
        [--repeat PLAIN_LOG_2]

With ``--repeat`` (a second run of the command without saves, same call), its iterations beside the writer are
read against the first's the same way: the worst and mean ratio two runs of one command give with no writer at all,
the noise the writer's figures carry.

With ``--disk`` (disk_watch.py's samples of each run, its log lines stamped ``[epoch] ``), each iteration beside
the writer also gets the bytes the disk read and wrote during it, beside the same iteration without saves, and
the page cache's dirty bytes at its start and end (torch_dist's writer writes through the page cache), and where
the samples have them, the cores the node kept busy (at nice <= 0; at nice > 0, torch_dist's niced writer; in
iowait) and its page faults (copy-on-write ones, while a forked writer lives, among them; the rank's own and its
descendants' apart), and the training
thread's time on a core, time waiting for one and context switches (whether the writers' threads took its cores,
or a lock its turns). With ``--trace`` (each
run's --offload-trace), each iteration's tier operations and update phases summed (trace_iterations.py), beside the
same iteration without saves: whether the disk or the CPU took the time. With ``--waits`` (thread_waits.py's
samples of each run), where the training thread was in each forward and backward beside the writer: on a core,
or which lock, device or page it waited on. With ``--maps`` (rank_maps.py's samples of each run), how each kind of
the rank's memory changed over each iteration beside the writer, private and shared dirty bytes apart: which pages
the forked writer's lifetime made it copy.

An iteration ran beside the writer of checkpoint N when its line comes after N's save line ("> checkpoint at
iteration N: training held") and the iteration before it ended before the writer did: the offloaded state's
end ("offloaded state ... paced:", the first rank's line) or, where there is none, the save's finalize line.
"""

from __future__ import annotations

import argparse
import math
import os
import re
import statistics
import sys
from collections import Counter
from typing import Dict, List, Optional, Tuple

GOAL = 1.25
HOLD_GOAL_S = 0.5  # issue 49 item 4: every --async-save holds training at most this, the first included
STAMP = re.compile(r"^\[(\d+\.\d+)\] ")
ITERATION = re.compile(r"iteration +(\d+)/.*elapsed time per iteration \(ms\): ([0-9.]+)")
SAVE = re.compile(r"> checkpoint at iteration (\d+): training held ([0-9.]+) s")
WRITER_END = re.compile(r"INFO offloaded state .*iter_0*(\d+)/.* paced: (.*)")
UPDATE = re.compile(r"iteration +(\d+)/.*offload update time \(ms\): ([0-9.]+)")
# the finalize line: the whole pause, at the save and in the updates after it that overtook the writer's copies
FINALIZED = re.compile(r"> saved checkpoint at iteration (\d+) .*finalized in the background.*training paused "
                       r"([0-9.]+) s \(([^)]*)\)")


def iteration_times(lines: List[str], pattern=ITERATION) -> Dict[int, float]:
    return {int(m.group(1)): float(m.group(2)) / 1e3 for m in map(pattern.search, lines) if m}


def split(it: int, times: Dict[int, float], updates: Dict[int, float]) -> str:
    """The iteration's update and the rest of it (forward, backward, the save's hold)."""
    if it not in updates:
        return "?"
    return f"update {updates[it]:.2f} + rest {times[it] - updates[it]:.2f}"


def beside(lines: List[str]) -> Dict[int, int]:
    """Iteration -> the checkpoint whose writer ran during it."""
    out, running, ended_before = {}, None, False
    for line in lines:
        save, end, fin, it = SAVE.search(line), WRITER_END.search(line), FINALIZED.search(line), ITERATION.search(line)
        if save:
            running, ended_before = int(save.group(1)), False
        elif (end or fin) and running is not None and int((end or fin).group(1)) == running:
            ended_before = True  # this iteration is the writer's last
        elif it and running is not None:
            out[int(it.group(1))] = running
            if ended_before:
                running = None
    return out


def iteration_ends(lines: List[str]) -> Dict[int, float]:
    """Iteration -> the epoch its line was stamped at (lines stamped by the experiment)."""
    ends = {}
    for line in lines:
        stamp, it = STAMP.search(line), ITERATION.search(line)
        if stamp and it:
            ends[int(it.group(1))] = float(stamp.group(1))
    return ends


def disk_samples(path: str) -> List[Tuple[float, ...]]:
    with open(path) as f:
        return [tuple(float(x) for x in line.split()) for line in f if line.strip()]


def at(samples, when: float):
    """The last sample taken at or before ``when`` (the first where none was)."""
    chosen = samples[0]
    for sample in samples:
        if sample[0] > when:
            break
        chosen = sample
    return chosen


def disk_during(it: int, ends: Dict[int, float], samples) -> Optional[Tuple[float, float, float, float]]:
    """(GB read, GB written, GB dirty at the start, GB dirty at the end) of iteration ``it``."""
    if it not in ends or it - 1 not in ends or not samples:
        return None
    first, last = at(samples, ends[it - 1]), at(samples, ends[it])
    return ((last[1] - first[1]) / 1e9, (last[2] - first[2]) / 1e9, first[3] / 1e9, last[3] / 1e9)


def cpu_during(it: int, ends: Dict[int, float], samples) -> Optional[Tuple[float, float, float, float]]:
    """(cores busy at nice <= 0, cores busy niced, cores in iowait, millions of page faults) over iteration ``it``,
    None where the samples have no CPU columns (an older disk_watch)."""
    if it not in ends or it - 1 not in ends or not samples or len(samples[0]) < 9:
        return None
    first, last = at(samples, ends[it - 1]), at(samples, ends[it])
    seconds = last[0] - first[0]
    if seconds <= 0:
        return None
    busy, niced, iowait = ((last[k] - first[k]) / seconds for k in (5, 6, 7))
    return busy, niced, iowait, (last[8] - first[8]) / 1e6


def thread_during(it: int, ends: Dict[int, float], samples) -> Optional[Tuple[float, float, float, float]]:
    """(seconds on a core, seconds waiting for one, voluntary and involuntary switches) of the training thread over
    iteration ``it``, None where the samples have no such columns or did not see the thread then."""
    if it not in ends or it - 1 not in ends or not samples or len(samples[0]) < 13:
        return None
    first, last = at(samples, ends[it - 1]), at(samples, ends[it])
    during = tuple(last[k] - first[k] for k in (9, 10, 11, 12))
    return None if any(math.isnan(x) for x in during) else during


def faults_during(it: int, ends: Dict[int, float], samples) -> Optional[Tuple[float, ...]]:
    """(millions of page faults of the rank, of its writers and other descendants[, of its training thread]) over
    iteration ``it``, None where the samples have no such columns or did not see the rank then."""
    if it not in ends or it - 1 not in ends or not samples or len(samples[0]) < 15:
        return None
    first, last = at(samples, ends[it - 1]), at(samples, ends[it])
    during = tuple((last[k] - first[k]) / 1e6 for k in range(13, min(len(first), 16)))
    return None if any(math.isnan(x) for x in during) else during


def phase_bounds(it: int, ends: Dict[int, float], updates: Dict[int, float], samples) -> Optional[tuple]:
    """The samples at iteration ``it``'s start (the iteration before's end), its update's start (its last
    ``updates[it]`` seconds) and its end; None where the samples or the update's time are missing."""
    if it not in ends or it - 1 not in ends or it not in updates or not samples:
        return None
    return at(samples, ends[it - 1]), at(samples, ends[it] - updates[it]), at(samples, ends[it])


def thread_in_phases(it: int, ends: Dict[int, float], updates: Dict[int, float], samples) -> Optional[Tuple[float, ...]]:
    """(voluntary switches, seconds on a core) of the training thread in iteration ``it``'s forward and backward,
    then the same in its update (``phase_bounds``), to the samples' interval; None where they lack it."""
    bounds = phase_bounds(it, ends, updates, samples)
    if bounds is None or len(samples[0]) < 13:
        return None
    start, update_from, end = bounds
    out = (update_from[11] - start[11], update_from[9] - start[9], end[11] - update_from[11], end[9] - update_from[9])
    return None if any(math.isnan(x) for x in out) else out


def disk_in_phases(it: int, ends: Dict[int, float], updates: Dict[int, float], samples) -> Optional[Tuple[float, ...]]:
    """(GB read, GB written) in iteration ``it``'s forward and backward, then the same in its update
    (``phase_bounds``); None where the samples or the update's time are missing."""
    bounds = phase_bounds(it, ends, updates, samples)
    if bounds is None:
        return None
    start, update_from, end = bounds
    return tuple((later[k] - earlier[k]) / 1e9 for earlier, later in ((start, update_from), (update_from, end))
                 for k in (1, 2))


def landed_row(phases: Dict[int, Tuple[tuple, tuple]], times: Tuple[Dict[int, float], Dict[int, float]],
               updates: Tuple[Dict[int, float], Dict[int, float]]) -> Optional[str]:
    """Over the iterations beside the writer (``phases``: iteration -> its ``disk_in_phases`` with saves and
    without): the disk bytes beyond the run without saves in their forwards and backwards (the tiers' quiet spells)
    and in their updates (beside the tiers' I/O), and the seconds each phase took beyond it (``times``,
    ``updates``: with saves, without): where the writers' bytes landed, and what they cost."""
    (times_a, times_b), (updates_a, updates_b) = times, updates
    its = [it for it in sorted(phases) if it in times_a and it in times_b]
    if not its:
        return None
    extra = [0.0] * 4  # GB beyond: in forward and backward, in update; s beyond: the same two
    for it in its:
        g, h = phases[it]
        extra[0] += g[0] + g[1] - h[0] - h[1]
        extra[1] += g[2] + g[3] - h[2] - h[3]
        extra[2] += (times_a[it] - updates_a[it]) - (times_b[it] - updates_b[it])
        extra[3] += updates_a[it] - updates_b[it]
    return (f"iterations {its[0]}-{its[-1]}: the disk moved {extra[0]:.2f} GB more in their forwards and backwards "
            f"and {extra[1]:.2f} GB more in their updates than without saves; they took {extra[2]:.2f} s and "
            f"{extra[3]:.2f} s more")


def disk_rows(during: Dict[int, int], async_lines: List[str], plain_lines: List[str], disks: List[str]) -> List[str]:
    ends_a, ends_b = iteration_ends(async_lines), iteration_ends(plain_lines)
    updates_a, updates_b = iteration_times(async_lines, UPDATE), iteration_times(plain_lines, UPDATE)
    samples_a, samples_b = disk_samples(disks[0]), disk_samples(disks[1])
    rows, phases = [], {}
    for it in sorted(during):
        a, b = disk_during(it, ends_a, samples_a), disk_during(it, ends_b, samples_b)
        if a is None or b is None:
            continue
        rows.append(f"  iteration {it}'s disk: read {a[0]:.2f} GB, wrote {a[1]:.2f} GB (without saves: read {b[0]:.2f}, "
                    f"wrote {b[1]:.2f}); page cache dirty {a[2]:.2f} GB at its start, {a[3]:.2f} GB at its end")
        g, h = disk_in_phases(it, ends_a, updates_a, samples_a), disk_in_phases(it, ends_b, updates_b, samples_b)
        if g is not None and h is not None:
            phases[it] = (g, h)
            rows.append(f"  iteration {it}'s disk in its forward and backward: read {g[0]:.2f} GB, wrote {g[1]:.2f} GB; "
                        f"in its update: read {g[2]:.2f}, wrote {g[3]:.2f} (without saves: {h[0]:.2f}, {h[1]:.2f}; "
                        f"{h[2]:.2f}, {h[3]:.2f})")
        c, d = cpu_during(it, ends_a, samples_a), cpu_during(it, ends_b, samples_b)
        if c is not None and d is not None:
            own, plain_own = faults_during(it, ends_a, samples_a), faults_during(it, ends_b, samples_b)
            whose = ("" if own is None or plain_own is None else
                     f"; of them the rank's {own[0]:.2f} M and its descendants' {own[1]:.2f} M (without saves: "
                     f"{plain_own[0]:.2f}, {plain_own[1]:.2f} M)")
            if own is not None and plain_own is not None and len(own) > 2 and len(plain_own) > 2:
                whose += f"; its training thread's {own[2]:.2f} M (without saves: {plain_own[2]:.2f} M)"
            rows.append(f"  iteration {it}'s CPU: {c[0]:.1f} cores busy, {c[1]:.1f} niced, {c[2]:.1f} in iowait, "
                        f"{c[3]:.2f} M page faults (without saves: {d[0]:.1f}, {d[1]:.1f}, {d[2]:.1f}, {d[3]:.2f} M)"
                        f"{whose}")
        e, f = thread_during(it, ends_a, samples_a), thread_during(it, ends_b, samples_b)
        if e is not None and f is not None:
            rows.append(f"  iteration {it}'s training thread: {e[0]:.2f} s on a core, {e[1]:.2f} s waiting for one, "
                        f"{e[2]:.0f} voluntary and {e[3]:.0f} involuntary switches (without saves: {f[0]:.2f} s, "
                        f"{f[1]:.2f} s, {f[2]:.0f}, {f[3]:.0f})")
        g, h = thread_in_phases(it, ends_a, updates_a, samples_a), thread_in_phases(it, ends_b, updates_b, samples_b)
        if g is not None and h is not None:
            rows.append(f"  iteration {it}'s training thread in its forward and backward: {g[0]:.0f} voluntary switches, "
                        f"{g[1]:.2f} s on a core; in its update: {g[2]:.0f}, {g[3]:.2f} s (without saves: {h[0]:.0f}, "
                        f"{h[1]:.2f} s; {h[2]:.0f}, {h[3]:.2f} s)")
    times = (iteration_times(async_lines), iteration_times(plain_lines))
    rows.append(landed_row(phases, times, (updates_a, updates_b)) or "no iteration's update split in both runs")
    return rows


def summed_rows(times: Dict[int, float], plain: Dict[int, float], first_save: int) -> List[str]:
    """The iterations after the first save summed against the same without saves, and those before it (from 2 on,
    no writer beside them): the two runs' own difference, against which the first is read."""
    rows = []
    for what, its in (("after the first save", [i for i in times if i > first_save and i in plain]),
                      ("before the first save", [i for i in times if 1 < i <= first_save and i in plain])):
        if its:
            rows.append(f"iterations {min(its)}-{max(its)} ({what}) together: "
                        f"{sum(times[i] for i in its) / sum(plain[i] for i in its):.2f}x the run without saves")
    return rows


def against_median_row(times: Dict[int, float], plain: Dict[int, float], during: Dict[int, int]) -> Optional[str]:
    """The iterations beside a writer against the median of the same iterations without saves, beside that
    run's own spread around its median: a step compared with the one step of the same number in another run
    carries that run's step-to-step noise as well."""
    its = [i for i in sorted(during) if i in times and i in plain]
    if not its:
        return None
    middle = statistics.median(plain[i] for i in its)
    ratios = [times[i] / middle for i in its]
    own = [plain[i] / middle for i in its]
    return (f"iterations {its[0]}-{its[-1]} beside the writer against the median of the same without saves "
            f"({middle:.2f} s; that run's own {min(own):.2f}-{max(own):.2f}x of it): worst {max(ratios):.2f}x, "
            f"mean {statistics.mean(ratios):.2f}x")


def repeat_row(async_lines: List[str], plain_lines: List[str], repeat_lines: List[str]) -> Optional[str]:
    """The steps beside the writer of a second run without saves against the first's: the statistic's own noise."""
    plain, repeat, during = iteration_times(plain_lines), iteration_times(repeat_lines), beside(async_lines)
    its = [i for i in sorted(during) if i in plain and i in repeat]
    if not its:
        return None
    ratios = [repeat[i] / plain[i] for i in its]
    return (f"iterations {its[0]}-{its[-1]} of a second run without saves against the first (no writer in either): "
            f"worst {max(ratios):.2f}x, mean {statistics.mean(ratios):.2f}x")


def report(async_lines: List[str], plain_lines: List[str],
           disks: Optional[List[str]] = None) -> Tuple[List[str], Optional[float]]:
    times, plain, during = iteration_times(async_lines), iteration_times(plain_lines), beside(async_lines)
    updates, plain_updates = iteration_times(async_lines, UPDATE), iteration_times(plain_lines, UPDATE)
    rows, worst = [], None
    for it in sorted(during):
        if it not in times or it not in plain:
            continue
        ratio = times[it] / plain[it]
        worst = ratio if worst is None else max(worst, ratio)
        rows.append(f"iteration {it}: {times[it]:.2f} s beside the writer of checkpoint {during[it]} "
                    f"({split(it, times, updates)}), {plain[it]:.2f} s without saves ({split(it, plain, plain_updates)}): "
                    f"{ratio:.2f}x")
    if disks:
        rows += disk_rows(during, async_lines, plain_lines, disks)
    quiet = [times[i] / plain[i] for i in sorted(times) if i not in during and i in plain and i > 1]
    if quiet:
        rows.append(f"the other iterations (2 on): {min(quiet):.2f}-{max(quiet):.2f}x the run without saves")
    holds = [(m.group(1), float(m.group(2))) for m in map(SAVE.search, async_lines) if m]
    if holds:
        rows += summed_rows(times, plain, int(holds[0][0]))
    rows += [f"save at {n}: held {held:.2f} s" for n, held in holds]
    rows += [line.strip()[:400] for line in async_lines if "async save: writer paced" in line or " paced: " in line]
    paused = {m.group(1): (float(m.group(2)), m.group(3)) for m in map(FINALIZED.search, async_lines) if m}
    rows += [f"checkpoint {n}: training paused {total:.2f} s ({parts})" for n, (total, parts) in paused.items()]
    if holds:  # a save's hold counts the updates after it that waited for its copies too
        longest = max(max(held, paused.get(n, (0.0,))[0]) for n, held in holds)
        rows.append(f"longest hold of a save, the updates' pauses after it included: {longest:.2f} s "
                    f"({'met' if longest <= HOLD_GOAL_S else 'NOT met'}: goal <= {HOLD_GOAL_S} s for every save)")
    if worst is not None:
        rows.append(f"worst iteration beside the writer: {worst:.2f}x the run without saves "
                    f"({'met' if worst <= GOAL else 'NOT met'}: goal <= {GOAL}x)")
        rows.append(against_median_row(times, plain, during))
    else:
        rows.append("no iteration ran beside a writer in both logs")
    return rows, worst


def trace_rows(during: Dict[int, int], async_lines: List[str], plain_lines: List[str], traces: List[str]) -> List[str]:
    from trace_iterations import by_iteration, row  # it reads this module's iteration_ends

    a, b = by_iteration(traces[0], iteration_ends(async_lines)), by_iteration(traces[1], iteration_ends(plain_lines))
    return [f"  iteration {it}'s engine: {row(a[it])} (without saves: {row(b[it])})"
            for it in sorted(during) if it in a and it in b]


def wait_windows(path: str) -> List[Tuple[float, Counter]]:
    """thread_waits.py's lines: (the window's end, its samples' counts by where the thread was)."""
    windows = []
    with open(path) as f:
        for line in f:
            fields = line.split()
            if len(fields) >= 2:
                counts = Counter({k: int(n) for k, _, n in (kv.rpartition("=") for kv in fields[2:])})
                windows.append((float(fields[0]), counts))
    return windows


def waits_between(windows: List[Tuple[float, Counter]], start: float, end: float) -> Counter:
    """The samples of the windows that ended in (start, end]."""
    total = Counter()
    for at_end, counts in windows:
        if start < at_end <= end:
            total += counts
    return total


def shares(counts: Counter, top: int = 4) -> str:
    n = sum(counts.values())
    return ", ".join(f"{key} {100 * c / n:.0f}%" for key, c in counts.most_common(top)) if n else "no samples"


def wait_rows(during: Dict[int, int], async_lines: List[str], plain_lines: List[str], waits: List[str]) -> List[str]:
    """Where the training thread was in each forward and backward beside the writer (from the iteration before's
    end to its update's start), its most frequent places as shares of the samples, beside the same without saves."""
    rows = []
    runs = [(iteration_ends(lines), iteration_times(lines, UPDATE), wait_windows(path))
            for lines, path in ((async_lines, waits[0]), (plain_lines, waits[1]))]
    for it in sorted(during):
        found = [waits_between(w, ends[it - 1], ends[it] - updates[it])
                 for ends, updates, w in runs if it - 1 in ends and it in ends and it in updates]
        if len(found) == 2:
            rows.append(f"  iteration {it}'s training thread in its forward and backward: {shares(found[0])} "
                        f"(without saves: {shares(found[1])})")
    return rows


def maps_rows(during: Dict[int, int], async_lines: List[str], plain_lines: List[str], maps: List[str]) -> List[str]:
    """The rank's memory over each iteration beside the writer (rank_maps.py's samples at or before its start and
    end): the change of each kind's private and shared dirty bytes where it moved by 1 MB or more, beside the
    same without saves. A copy-on-write moves bytes from shared to private; new memory adds private only."""
    from rank_maps import KINDS, parse_line

    def samples(path):
        with open(path) as f:
            return [s for s in map(parse_line, f) if s is not None]

    def change(ends, found, it):
        if it - 1 not in ends or it not in ends or not found:
            return None
        first, last = at(found, ends[it - 1])[1], at(found, ends[it])[1]
        return {k: tuple((last.get(k, (0, 0, 0))[i] - first.get(k, (0, 0, 0))[i]) / 1024 for i in (1, 2))
                for k in KINDS}

    def moved(delta):
        parts = [f"{k} {p:+.0f}/{q:+.0f}" for k, (p, q) in delta.items() if abs(p) >= 1 or abs(q) >= 1]
        return ", ".join(parts) or "no kind moved 1 MB"

    runs = [(iteration_ends(lines), samples(path)) for lines, path in ((async_lines, maps[0]), (plain_lines, maps[1]))]
    rows = []
    for it in sorted(during):
        a, b = (change(ends, found, it) for ends, found in runs)
        if a is not None and b is not None:
            rows.append(f"  iteration {it}'s rank memory, MB private/shared dirty: {moved(a)} (without saves: "
                        f"{moved(b)})")
    return rows


def parse(argv: List[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog=os.path.basename(argv[0]),
                                     description="The iterations beside an --async-save writer against a run "
                                                 "without saves, from the two console logs.")
    parser.add_argument("async_log", help="the console log of the run with --async-save")
    parser.add_argument("plain_log", help="the console log of the same run without saves")
    for flag, what in (("--disk", "disk_watch.py's samples"), ("--trace", "--offload-trace files"),
                       ("--waits", "thread_waits.py's samples"), ("--maps", "rank_maps.py's samples")):
        parser.add_argument(flag, nargs=2, metavar=("ASYNC", "PLAIN"),
                            help=f"{what} of each run (left out where either file is missing: an older run)")
    parser.add_argument("--repeat", metavar="PLAIN_2", help="the console log of a second run without saves")
    args = parser.parse_args(argv[1:])
    for path in (args.async_log, args.plain_log) + ((args.repeat,) if args.repeat else ()):
        if not os.path.isfile(path):
            parser.error(f"{path}: no such log")
    for flag in ("disk", "trace", "waits", "maps"):
        pair = getattr(args, flag)
        if pair is not None and not all(os.path.exists(p) for p in pair):
            setattr(args, flag, None)
    return args


def main(argv: List[str]) -> int:
    args = parse(argv)
    with open(args.async_log) as a, open(args.plain_log) as b:
        async_lines, plain_lines = a.read().splitlines(), b.read().splitlines()
    rows, _ = report(async_lines, plain_lines, args.disk)
    if args.repeat:
        with open(args.repeat) as c:
            rows.append(repeat_row(async_lines, plain_lines, c.read().splitlines()) or
                        f"{args.repeat}: no iteration beside the writer in it")
    if args.trace:
        rows += trace_rows(beside(async_lines), async_lines, plain_lines, args.trace)
    if args.waits:
        rows += wait_rows(beside(async_lines), async_lines, plain_lines, args.waits)
    if args.maps:
        rows += maps_rows(beside(async_lines), async_lines, plain_lines, args.maps)
    print("\n".join(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
