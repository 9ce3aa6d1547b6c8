"""What a profiled iteration's threads and GPU streams did, one run against another: two Chrome traces written by
--profile --profile-dir (torch.profiler, every thread's operators and CUDA runtime calls) over the same iteration,
e.g. the first after an --async-save and the same iteration of a run without saves.

Each thread with events is read over its span, from its first event to its last: the time inside events (the
union of their intervals), the time between them (Python, the interpreter's lock, anything not recorded), and each
event name's own time (its duration less its children's on the same thread). The threads of the two traces are
paired by their number of events, busiest first, and for each pair the names whose own time grew most are listed.
The GPU's streams (kernels, copies, memsets), paired by busy time, say how long each was busy over its span: where
the training thread's span grew and the busiest stream's busy time did not, the GPU waited for the CPU.

    python benchmarks/experiments/profile_diff.py A_TRACE B_TRACE [--top N] [--threads K]
"""

from __future__ import annotations

import argparse
import json
from collections import Counter, defaultdict
from typing import Dict, List, Tuple

CPU_CATEGORIES = {"cpu_op", "cuda_runtime", "cuda_driver", "user_annotation", "python_function"}
GPU_CATEGORIES = {"kernel", "gpu_memcpy", "gpu_memset"}


def events_by(trace: dict, categories: set, key) -> Dict[object, List[Tuple[float, float, str]]]:
    """Per ``key(event)``: (start us, duration us, name) of the complete events of those categories."""
    groups: Dict[object, List[Tuple[float, float, str]]] = defaultdict(list)
    for e in trace.get("traceEvents", []):
        if e.get("ph") == "X" and e.get("cat") in categories and "dur" in e:
            groups[key(e)].append((float(e["ts"]), float(e["dur"]), e["name"]))
    return groups


def cpu_events(trace: dict) -> Dict[int, List[Tuple[float, float, str]]]:
    """Per thread id: its CPU-side events."""
    return events_by(trace, CPU_CATEGORIES, lambda e: int(e["tid"]))


def gpu_streams(trace: dict) -> Dict[str, List[Tuple[float, float, str]]]:
    """Per GPU stream ("device D stream S"): its kernels, copies and memsets."""
    return events_by(trace, GPU_CATEGORIES, lambda e: f"device {e.get('pid')} stream {e.get('tid')}")


def own_times(events: List[Tuple[float, float, str]]) -> Tuple[Counter, Counter, float]:
    """Each name's own time (its duration less its children's on the thread) and count, and the union of all
    intervals (the time inside some event)."""
    own: Counter = Counter()
    count: Counter = Counter()
    stack: List[Tuple[float, str]] = []  # the open events: (end, name)
    inside = 0.0
    covered_to = float("-inf")
    for start, dur, name in sorted(events, key=lambda e: (e[0], -e[1])):
        end = start + dur
        while stack and stack[-1][0] <= start:
            stack.pop()
        count[name] += 1
        own[name] += dur
        if stack:  # a child: its time is not its parent's own (clipped to the parent's end)
            own[stack[-1][1]] -= min(end, stack[-1][0]) - start
        stack.append((end, name))
        if end > covered_to:
            inside += end - max(start, covered_to)
            covered_to = end
    return own, count, inside


def read(path: str) -> dict:
    """Each thread's reading, busiest (most events) first."""
    with open(path) as f:
        trace = json.load(f)
    threads = cpu_events(trace)
    if not threads:
        raise SystemExit(f"{path}: no CPU events (written by --profile --profile-dir?)")
    readings = []
    for tid in sorted(threads, key=lambda t: len(threads[t]), reverse=True):
        events = threads[tid]
        own, count, inside = own_times(events)
        span = max(s + d for s, d, _ in events) - min(s for s, _, _ in events)
        readings.append({"tid": tid, "span_us": span, "inside_us": inside, "own": own, "count": count})
    streams = []
    for name, events in gpu_streams(trace).items():
        own, count, busy = own_times(events)
        streams.append({"stream": name, "busy_us": busy, "events": sum(count.values()),
                        "span_us": max(s + d for s, d, _ in events) - min(s for s, _, _ in events)})
    streams.sort(key=lambda r: r["busy_us"], reverse=True)
    return {"path": path, "threads": readings, "streams": streams}


def compare(a: dict, b: dict, top: int) -> List[str]:
    """One thread of the first trace against its counterpart in the second."""
    ms = 1e-3
    lines = [f"  span {a['span_us'] * ms:.1f} / {b['span_us'] * ms:.1f} ms ({(a['span_us'] - b['span_us']) * ms:+.1f}), "
             f"inside events {a['inside_us'] * ms:.1f} / {b['inside_us'] * ms:.1f} "
             f"({(a['inside_us'] - b['inside_us']) * ms:+.1f}), between them "
             f"{(a['span_us'] - a['inside_us']) * ms:.1f} / {(b['span_us'] - b['inside_us']) * ms:.1f} "
             f"({((a['span_us'] - a['inside_us']) - (b['span_us'] - b['inside_us'])) * ms:+.1f}); events "
             f"{sum(a['count'].values())} / {sum(b['count'].values())}"]
    names = set(a["own"]) | set(b["own"])
    grown = sorted(names, key=lambda n: a["own"][n] - b["own"][n], reverse=True)
    lines.append("  own time by name, most grown first (ms first / second, change; counts first / second):")
    for n in grown[:top]:
        lines.append(f"    {n}: {a['own'][n] * ms:.1f} / {b['own'][n] * ms:.1f}, {(a['own'][n] - b['own'][n]) * ms:+.1f}; "
                     f"{a['count'][n]} / {b['count'][n]}")
    shrunk = [n for n in reversed(grown) if a["own"][n] < b["own"][n]][:3]
    if shrunk:
        lines.append("  most shrunk: " + ", ".join(f"{n} {(a['own'][n] - b['own'][n]) * ms:+.1f} ms" for n in shrunk))
    return lines


def report(a: dict, b: dict, top: int = 12, threads: int = 3) -> List[str]:
    """The first trace's threads against the second's, paired by their rank in events (thread ids differ between
    runs; on a GPU the backward runs on autograd's device thread, the forward and the update on the main one)."""
    lines = [f"first: {a['path']}; second: {b['path']}",
             f"threads with events: {len(a['threads'])} / {len(b['threads'])}"]
    for k, (ta, tb) in enumerate(zip(a["threads"][:threads], b["threads"][:threads]), 1):
        lines.append(f"thread {k} by events (ids {ta['tid']} / {tb['tid']}):")
        lines += compare(ta, tb, top)
    ms = 1e-3
    for k, (sa, sb) in enumerate(zip(a["streams"][:threads], b["streams"][:threads]), 1):
        # a stream idle for much of the training thread's span: the GPU waited for the CPU
        lines.append(f"GPU stream {k} by busy time ({sa['stream']} / {sb['stream']}): busy {sa['busy_us'] * ms:.1f} / "
                     f"{sb['busy_us'] * ms:.1f} ms ({(sa['busy_us'] - sb['busy_us']) * ms:+.1f}) over "
                     f"{sa['span_us'] * ms:.1f} / {sb['span_us'] * ms:.1f} ms from its first to its last; "
                     f"{sa['events']} / {sb['events']} kernels and copies")
    return lines


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("first")
    p.add_argument("second")
    p.add_argument("--top", type=int, default=12, help="names per thread")
    p.add_argument("--threads", type=int, default=3, help="threads compared, busiest first")
    args = p.parse_args(argv)
    print("\n".join(report(read(args.first), read(args.second), args.top, args.threads)))


if __name__ == "__main__":
    main()
