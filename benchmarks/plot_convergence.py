"""Convergence by moment format (issue 39 item 2): reads converge_moments.sh's outputs, prints each variant's final
validation loss and its gap to bf16 and fp32 moments (NaN or a missing run is said, never hidden), and with --png
draws the training-loss curves (a 50-step running mean) and the validation points.

    python3 benchmarks/plot_convergence.py DIR fp32 bf16 fp8
    python3 benchmarks/plot_convergence.py --png docs/results/converge.png DIR fp32 bf16 fp8
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
from typing import Dict, List, Optional, Tuple

VALIDATION = re.compile(r"validation loss at iteration (\d+) \| lm loss value: ([-+.\deEnaNif]+)")


def training_losses(directory: str, variant: str) -> List[Tuple[int, float]]:
    path = os.path.join(directory, f"converge_{variant}.jsonl")
    if not os.path.exists(path):
        return []
    with open(path) as f:
        return [(r["iteration"], float(r["loss"])) for r in map(json.loads, f)]


def validation_losses(directory: str, variant: str) -> List[Tuple[int, float]]:
    path = os.path.join(directory, f"converge_{variant}.log")
    if not os.path.exists(path):
        return []
    with open(path) as f:
        return [(int(m.group(1)), float(m.group(2))) for m in VALIDATION.finditer(f.read())]


def final(directory: str, variant: str) -> Optional[Tuple[int, float]]:
    points = validation_losses(directory, variant)
    return points[-1] if points else None


def summary(directory: str, variants: List[str]) -> List[str]:
    """Each variant's last validation loss, and the gaps at the last iteration every variant reached (a run cut
    short is compared where the others were then, and said so)."""
    points = {v: dict(validation_losses(directory, v)) for v in variants}
    reached = [set(p) for p in points.values() if p]
    common = max(set.intersection(*reached)) if reached and set.intersection(*reached) else None
    lines = []
    for v in variants:
        train = training_losses(directory, v)
        bad = [it for it, loss in train if not math.isfinite(loss)]
        if not points[v]:
            lines.append(f"{v}: no validation loss (the run failed or did not reach an evaluation); "
                         f"{len(train)} training steps logged")
            continue
        it = max(points[v])
        text = f"{v}: final validation loss {points[v][it]:.4f} at iteration {it}, {len(train)} steps logged"
        if bad:
            text += f"; NON-FINITE training loss at iterations {bad[:5]}"
        if common is not None:
            gaps = [f"{100 * (points[v][common] / points[ref][common] - 1):+.2f}% vs {ref}"
                    for ref in ("bf16", "fp32") if ref != v and points.get(ref)]
            if gaps:
                text += f"; at iteration {common} (the last all reached) {points[v][common]:.4f}: " + ", ".join(gaps)
        lines.append(text)
    return lines


def plot(directory: str, variants: List[str], png: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(8, 5))
    for v in variants:
        train = training_losses(directory, v)
        if train:
            its, losses = zip(*train)
            window = 50
            smooth = [sum(losses[max(0, i - window + 1): i + 1]) / len(losses[max(0, i - window + 1): i + 1])
                      for i in range(len(losses))]
            line, = ax.plot(its, smooth, label=f"{v} moments, training (50-step mean)")
            val = validation_losses(directory, v)
            if val:
                ax.plot(*zip(*val), "o", color=line.get_color(), label=f"{v} moments, validation")
    ax.set_xlabel("iteration")
    ax.set_ylabel("loss (nats per byte)")
    ax.set_ylim(top=3.0)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(png, dpi=120)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("directory")
    parser.add_argument("variants", nargs="+")
    parser.add_argument("--png", default=None)
    args = parser.parse_args()
    for line in summary(args.directory, args.variants):
        print(line)
    if args.png:
        plot(args.directory, args.variants, args.png)


if __name__ == "__main__":
    main()
