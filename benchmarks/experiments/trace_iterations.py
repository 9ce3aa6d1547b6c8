"""An engine trace (--offload-trace, mlp_offload/telemetry/trace.py) summed per iteration, for telling apart what
slowed an iteration: its tier operations (the disk), their token waits, or the update's own phases (the CPU).

    python benchmarks/experiments/trace_iterations.py TRACE_JSON LOG

LOG: the run's console log, its lines stamped ``[epoch] `` (determinism.sh's stamp_epoch), whose iteration lines
bound each iteration. An event belongs to the iteration during which it started.
"""

from __future__ import annotations

import json
import sys
from collections import defaultdict
from typing import Dict, List

from beside_writer import iteration_ends


def by_iteration(trace_path: str, ends: Dict[int, float]) -> Dict[int, Dict[str, float]]:
    """iteration -> {"<tier> read s", "<tier> read GB", "<tier> write s", ..., "token wait s", "<phase> s"}: seconds
    summed over the events that started during it (operations on several threads add up past the wall time)."""
    with open(trace_path) as f:
        events = [e for e in json.load(f)["traceEvents"] if e.get("ph") == "X"]
    bounds = sorted(ends.items())
    sums: Dict[int, Dict[str, float]] = defaultdict(lambda: defaultdict(float))
    for event in events:
        start = event["ts"] / 1e6
        it = next((n for (m, before), (n, end) in zip(bounds, bounds[1:]) if before < start <= end), None)
        if it is None:
            continue
        seconds, args = event["dur"] / 1e6, event.get("args", {})
        if event["cat"] in ("read", "write"):
            sums[it][f"{args.get('tier')} {event['cat']} s"] += seconds
            sums[it][f"{args.get('tier')} {event['cat']} GB"] += args.get("bytes", 0) / 1e9
        elif event["cat"] == "token":
            sums[it]["token wait s"] += seconds
        else:
            sums[it][f"{event['name']} s"] += seconds
    return {it: dict(values) for it, values in sums.items()}


def row(values: Dict[str, float]) -> str:
    """One iteration's sums in one line: each tier's reads and writes with their rate per operation, then the rest."""
    parts = []
    for key in sorted(k for k in values if k.endswith(" s") and (" read " in k or " write " in k)):
        gb = values.get(key[:-2] + " GB", 0.0)
        parts.append(f"{key[:-2]} {gb:.2f} GB in {values[key]:.2f} s" + (f" ({gb / values[key]:.2f} GB/s)"
                                                                         if values[key] > 0 else ""))
    parts += [f"{key[:-2]} {values[key]:.2f} s" for key in sorted(values)
              if key.endswith(" s") and " read " not in key and " write " not in key]
    return "; ".join(parts)


def main(argv: List[str]) -> int:
    with open(argv[2]) as f:
        ends = iteration_ends(f.read().splitlines())
    for it, values in sorted(by_iteration(argv[1], ends).items()):
        print(f"iteration {it}: {row(values)}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
