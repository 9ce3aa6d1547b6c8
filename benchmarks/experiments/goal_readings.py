"""Issue 49's goal lines of several runs with --async-save, side by side and as ranges: each save's hold, the worst
step beside the writer against the same step of the run without saves and against that run's median, and the steps
after the first save (and before it) together.

    python benchmarks/experiments/goal_readings.py docs/results/*/*/determinism_beside_writer_A8*.txt

Each file is one run's beside_writer.py reading (determinism.sh writes it). The ranges are what the README quotes
for a set of runs of one code; the count of runs at or under the goal (1.25x, 0.5 s) is given beside them.
"""

from __future__ import annotations

import re
import sys
from typing import Dict, List, Optional

HELD = re.compile(r"^save at (\d+): held ([0-9.]+) s$", re.M)
WORST = re.compile(r"^worst iteration beside the writer: ([0-9.]+)x", re.M)
WORST_AT = re.compile(r"^iteration (\d+): .*: ([0-9.]+)x$", re.M)
MEDIAN = re.compile(r"^iterations [0-9-]+ beside the writer against the median .*: worst ([0-9.]+)x, mean ([0-9.]+)x$",
                    re.M)
AFTER = re.compile(r"^iterations [0-9-]+ \(after the first save\) together: ([0-9.]+)x", re.M)
BEFORE = re.compile(r"^iterations [0-9-]+ \(before the first save\) together: ([0-9.]+)x", re.M)
STEP_GOAL, HOLD_GOAL = 1.25, 0.5


def reading(text: str) -> Optional[Dict[str, object]]:
    """One run's goal figures, or None where the file has no worst step (a run without a reading)."""
    worst = WORST.search(text)
    if worst is None:
        return None
    steps = [(int(i), float(r)) for i, r in WORST_AT.findall(text)]
    median, after, before = MEDIAN.search(text), AFTER.search(text), BEFORE.search(text)
    saves = HELD.findall(text)
    worst_at = max(steps, key=lambda s: s[1])[0] if steps else None
    return {
        "holds": [float(s) for _, s in saves],
        "worst": float(worst.group(1)),
        "worst_at": worst_at,
        "first_after_save": worst_at is not None and worst_at - 1 in {int(i) for i, _ in saves},
        "worst_median": float(median.group(1)) if median else None,
        "mean_median": float(median.group(2)) if median else None,
        "after": float(after.group(1)) if after else None,
        "before": float(before.group(1)) if before else None,
    }


def span(values: List[float], unit: str) -> str:
    return f"{min(values):.2f}-{max(values):.2f}{unit}" if values else "none"


def report(readings: Dict[str, Dict[str, object]]) -> List[str]:
    lines = []
    for path, r in readings.items():
        lines.append(f"{path}: holds {', '.join(f'{h:.2f}' for h in r['holds'])} s; worst step {r['worst']:.2f}x "
                     f"(iteration {r['worst_at']}), {r['worst_median']}x against the median (mean {r['mean_median']}x); "
                     f"after the first save together {r['after']}x (before it {r['before']}x)")
    rs = list(readings.values())
    holds = [h for r in rs for h in r["holds"]]
    worst = [r["worst"] for r in rs]
    median = [r["worst_median"] for r in rs if r["worst_median"] is not None]
    after = [r["after"] for r in rs if r["after"] is not None]
    lines.append(f"{len(rs)} runs: holds {span(holds, ' s')} ({sum(h <= HOLD_GOAL for h in holds)} of {len(holds)} "
                 f"<= {HOLD_GOAL} s); worst step {span(worst, 'x')} ({sum(w <= STEP_GOAL for w in worst)} of "
                 f"{len(worst)} <= {STEP_GOAL}x), against the median {span(median, 'x')} "
                 f"({sum(m <= STEP_GOAL for m in median)} of {len(median)}); the steps after the first save together "
                 f"{span(after, 'x')}; the worst step the first after a save in "
                 f"{sum(bool(r['first_after_save']) for r in rs)} of {len(rs)}")
    return lines


def main(paths: List[str]) -> None:
    if not paths:
        sys.exit(__doc__)
    readings = {}
    for path in paths:
        with open(path) as f:
            text = f.read()
        r = reading(text)
        if r is None:
            print(f"{path}: no worst step (not a reading of a run with saves)")
            continue
        readings[path] = r
    print("\n".join(report(readings)))


if __name__ == "__main__":
    main(sys.argv[1:])
