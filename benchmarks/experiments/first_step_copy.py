"""The first step after a save against the copy aside that runs beside it, over many readings of beside_writer.py.

    python benchmarks/experiments/first_step_copy.py docs/results/*/*/determinism_beside_writer_*.txt
    python benchmarks/experiments/first_step_copy.py --own [--save N] docs/results/*/*/determinism_A8*.log

For each reading: the first save's "copied aside first in S s" (the state held in memory copied into the
snapshot's staging before the writer's first chunk) and the first step beside the writer's ratio to the run without
saves. Then how the two go together over the readings: Pearson's r, with and without the slowest copy, and
Spearman's rank correlation (ties ranked by their mean), so that one outlier does not make the whole finding.

``--own``: where a run has no run without saves beside it, each run's steps after its first save (at N, default 8)
against the median of its own steps 3 to N-1 (after the first two's warm-up): the first step's ratio, and the most
and the mean over the six steps after the save. A run without saves read the same way shows the drift this reading
has without any writer.
"""

from __future__ import annotations

import re
import sys
from typing import List, Optional, Tuple

import numpy as np

from beside_writer import iteration_times  # this script's directory, as when run beside it
COPY = re.compile(r"([0-9.]+) GB copied aside first in ([0-9.]+) s")
FIRST_STEP = re.compile(r"^iteration (\d+): .*: ([0-9.]+)x$", re.M)


def reading(text: str) -> Optional[Tuple[float, float, float, int]]:
    """(GB copied, its seconds, the first step's ratio, that step) of one beside_writer.py output, or None."""
    copy, step = COPY.search(text), FIRST_STEP.search(text)
    if copy is None or step is None:
        return None
    return float(copy.group(1)), float(copy.group(2)), float(step.group(2)), int(step.group(1))


def own_base_and_ratios(text: str, save_at: int = 8, after: int = 6) -> Optional[Tuple[float, List[float]]]:
    """(median s of steps 3..save_at-1, each of the ``after`` steps after the save as a ratio to it) from a run's
    iteration lines, or None where a step is missing."""
    seconds = iteration_times(text.splitlines())
    before, later = range(3, save_at), range(save_at + 1, save_at + 1 + after)
    if any(i not in seconds for i in (*before, *later)):
        return None
    base = float(np.median([seconds[i] for i in before]))
    return base, [seconds[i] / base for i in later]


def own_reading(text: str, save_at: int = 8, after: int = 6) -> Optional[Tuple[float, float, float, float]]:
    """(median s of steps 3..save_at-1, the first step after the save's ratio to it, the most and the mean ratio of
    the ``after`` steps after the save) from a run's iteration lines, or None where a step is missing."""
    found = own_base_and_ratios(text, save_at, after)
    if found is None:
        return None
    base, ratios = found
    return base, ratios[0], max(ratios), sum(ratios) / len(ratios)


def main_own(paths: List[str], save_at: int) -> int:
    for path in paths:
        with open(path) as f:
            found = own_reading(f.read(), save_at)
        if found is None:
            print(f"{path}: steps 3-{save_at + 6} not all in it, skipped")
            continue
        base, first, most, mean = found
        print(f"{path}: steps 3-{save_at - 1} median {base:.2f} s; step {save_at + 1} {first:.2f}x; "
              f"steps {save_at + 1}-{save_at + 6} at most {most:.2f}x, mean {mean:.2f}x")
    return 0


def ranks(values: np.ndarray) -> np.ndarray:
    order = np.argsort(values, kind="stable")
    ranked = np.empty(len(values))
    ranked[order] = np.arange(len(values), dtype=float)
    for v in np.unique(values):  # ties share their mean rank
        same = values == v
        ranked[same] = ranked[same].mean()
    return ranked


def correlations(seconds: np.ndarray, ratios: np.ndarray) -> dict:
    out = {"pearson": float(np.corrcoef(seconds, ratios)[0, 1]),
           "spearman": float(np.corrcoef(ranks(seconds), ranks(ratios))[0, 1])}
    keep = seconds < seconds.max()
    if keep.sum() >= 3:
        out["pearson_without_slowest"] = float(np.corrcoef(seconds[keep], ratios[keep])[0, 1])
    return out


def main(paths: List[str]) -> int:
    rows = []
    for path in paths:
        with open(path) as f:
            found = reading(f.read())
        if found is None:
            print(f"{path}: no copy aside or first step in it, skipped")
            continue
        gb, s, ratio, step = found
        rows.append((s, ratio))
        print(f"{path}: {gb:.2f} GB copied aside in {s:.2f} s; iteration {step}: {ratio:.2f}x")
    if len(rows) < 3:
        print(f"{len(rows)} readings: too few to correlate")
        return 1
    seconds, ratios = (np.array(c) for c in zip(*rows))
    c = correlations(seconds, ratios)
    print(f"{len(rows)} readings: Pearson r {c['pearson']:.2f}"
          + (f" ({c['pearson_without_slowest']:.2f} without the slowest copy, {seconds.max():.2f} s)"
             if "pearson_without_slowest" in c else "")
          + f", Spearman {c['spearman']:.2f}")
    return 0


if __name__ == "__main__":
    if len(sys.argv) < 2:
        sys.exit(__doc__)
    if sys.argv[1] == "--own":
        args = sys.argv[2:]
        save = 8
        if args[:1] == ["--save"]:
            save, args = int(args[1]), args[2:]
        sys.exit(main_own(args, save))
    sys.exit(main(sys.argv[1:]))
