"""Draw offload-engine traces (``--offload-trace``, Chrome-trace JSON) as one PNG timeline.

  python3 tools/plot_timeline.py trace-0.json trace-1.json timeline.png

One lane per rank and tier (its reads, writes and token waits; the tier's operation threads drawn
over each other) and one per rank for compute (read waits, gradients, Adam, params callback).
Time in seconds from the first event of all files.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections import defaultdict

try:
    import matplotlib
except ImportError:  # optional (tools/setup_env.sh installs it where it can be had): one line, no traceback
    sys.exit("error: tools/plot_timeline.py: needs the matplotlib package, which is not installed here "
             "(pip install matplotlib==3.10.3)")

matplotlib.use("Agg")  # headless
import matplotlib.pyplot as plt  # noqa: E402
from matplotlib.patches import Patch  # noqa: E402

COLORS = {
    "read": "tab:blue", "write": "tab:orange", "token wait": "tab:gray",
    "read wait": "tab:red", "write wait": "tab:pink", "gradients": "tab:purple",
    "adam": "tab:green", "params callback": "tab:olive",
}
OTHER = "black"


def load_events(paths):
    events = []
    for path in paths:
        with open(path) as f:
            events += [e for e in json.load(f)["traceEvents"] if e.get("ph") == "X"]
    return events


def lanes_of(events):
    """(rank, lane label) -> events; compute first, then tiers by name, per rank."""
    lanes = defaultdict(list)
    for e in events:
        tier = e.get("args", {}).get("tier") if e["tid"] != 0 else None
        lanes[(e["pid"], tier or "compute")].append(e)
    return dict(sorted(lanes.items(), key=lambda kv: (kv[0][0], kv[0][1] != "compute", kv[0][1])))


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("traces", nargs="+", help="trace JSON files, then the PNG to write")
    args = p.parse_args(argv)
    if len(args.traces) < 2:
        p.error("give at least one trace file and the output PNG")
    *paths, png = args.traces
    events = load_events(paths)
    if not events:
        raise SystemExit(f"no events in {', '.join(paths)}")
    lanes = lanes_of(events)
    t0 = min(e["ts"] for e in events)

    fig, ax = plt.subplots(figsize=(14, 1.0 + 0.6 * len(lanes)))
    seen = set()
    for row, ((rank, label), lane) in enumerate(lanes.items()):
        by_kind = defaultdict(list)
        for e in lane:
            by_kind[e["name"]].append(((e["ts"] - t0) / 1e6, e["dur"] / 1e6))
        for kind, bars in by_kind.items():
            # Alpha: a tier's concurrent operations overlap in one lane and stay visible.
            ax.broken_barh(bars, (row - 0.4, 0.8), facecolors=COLORS.get(kind, OTHER), alpha=0.75, linewidth=0)
            seen.add(kind)
    ax.set_yticks(range(len(lanes)))
    ax.set_yticklabels([f"rank {rank} {label}" for rank, label in lanes])
    ax.invert_yaxis()
    ax.set_xlabel("time (s)")
    ax.set_title(f"offload engine timeline ({len(paths)} trace file{'s' if len(paths) > 1 else ''})")
    ax.grid(axis="x", alpha=0.3)
    order = [k for k in COLORS if k in seen] + sorted(seen - set(COLORS))
    ax.legend(handles=[Patch(color=COLORS.get(k, OTHER), label=k) for k in order],
              loc="upper left", bbox_to_anchor=(1.0, 1.0), fontsize=8)
    fig.tight_layout()
    fig.savefig(png, dpi=120)
    print(f"wrote {png}: {len(events)} events in {len(lanes)} lanes")


if __name__ == "__main__":
    main()
