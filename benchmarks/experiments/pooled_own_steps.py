"""The steps after a save against each run's own steps before it, pooled over many runs with saves and many
without: how far the writer moves the steps beyond the drift a run shows with no writer at all.

    python benchmarks/experiments/pooled_own_steps.py --with A8_LOGS... --without B8_LOGS... [--save N]

Each run's steps N+1..N+6 (default N = 8) are read against the median of its own steps 3..N-1
(``first_step_copy.own_base_and_ratios``): a run with --async-save has the writer beside those steps, a run
without saves has nothing beside them, and its ratios are the reading's own drift. Both groups' ratios are pooled:
their mean, median, 90th percentile and most, and how many are over the goal (1.25x). Then the difference of the
two means with a bootstrap interval (runs resampled, not steps: a run's steps share its machine's state).
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import List, Optional, Sequence, Tuple

import numpy as np

from first_step_copy import own_base_and_ratios  # this script's directory, as when run beside it

GOAL = 1.25
RESAMPLES = 4000


def group_ratios(paths: Sequence[str], save_at: int) -> Tuple[List[List[float]], List[str]]:
    """Each readable run's ratios, and the paths skipped (steps missing)."""
    runs, skipped = [], []
    for path in paths:
        with open(path) as f:
            found = own_base_and_ratios(f.read(), save_at)
        if found is None:
            skipped.append(path)
        else:
            runs.append(found[1])
    return runs, skipped


def describe(runs: List[List[float]]) -> str:
    pooled = np.array([r for run in runs for r in run])
    return (f"{len(runs)} runs, {pooled.size} steps: mean {pooled.mean():.3f}x, median {np.median(pooled):.3f}x, "
            f"90th percentile {np.percentile(pooled, 90):.3f}x, most {pooled.max():.2f}x; "
            f"{int((pooled > GOAL).sum())} of {pooled.size} over {GOAL}x")


def mean_difference(with_writer: List[List[float]], without: List[List[float]],
                    seed: int = 0) -> Tuple[float, float, float]:
    """The pooled mean with the writer less the one without, and its 5th-95th percentile over resampled runs."""
    rng = np.random.default_rng(seed)

    def pooled_mean(runs: List[List[float]], picks: Optional[np.ndarray] = None) -> float:
        chosen = runs if picks is None else [runs[i] for i in picks]
        return float(np.mean([r for run in chosen for r in run]))

    diffs = [pooled_mean(with_writer, rng.integers(0, len(with_writer), len(with_writer)))
             - pooled_mean(without, rng.integers(0, len(without), len(without))) for _ in range(RESAMPLES)]
    low, high = np.percentile(diffs, [5, 95])
    return pooled_mean(with_writer) - pooled_mean(without), float(low), float(high)


def main(argv: List[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--with", dest="with_writer", nargs="+", required=True, metavar="LOG",
                        help="console logs of runs with --async-save")
    parser.add_argument("--without", nargs="+", required=True, metavar="LOG", help="console logs of runs without saves")
    parser.add_argument("--save", type=int, default=8, help="the first save's iteration (default 8)")
    args = parser.parse_args(argv)
    missing = [path for path in args.with_writer + args.without if not os.path.isfile(path)]
    if missing:
        parser.error(f"no such log: {', '.join(missing)}")
    with_writer, skipped = group_ratios(args.with_writer, args.save)
    without, skipped_too = group_ratios(args.without, args.save)
    for path in skipped + skipped_too:
        print(f"{path}: steps 3-{args.save + 6} not all in it, left out")
    if not with_writer or not without:
        print("pooled_own_steps.py: each group needs one run with steps 3 to "
              f"{args.save + 6} at least", file=sys.stderr)
        return 2
    print(f"with the writer beside steps {args.save + 1}-{args.save + 6}: {describe(with_writer)}")
    print(f"without saves, the same steps: {describe(without)}")
    diff, low, high = mean_difference(with_writer, without)
    print(f"the writer's mean cost beyond the drift: {diff:+.3f}x (5th-95th percentile over resampled runs "
          f"{low:+.3f} to {high:+.3f})")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
