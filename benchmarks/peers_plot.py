"""Stacked bars from compare_offload.json: forward+backward and update seconds per system.

  python3 benchmarks/peers_plot.py $OUT/compare_offload.json $OUT/phases.png
"""

from __future__ import annotations

import argparse
import json
import textwrap

import matplotlib

matplotlib.use("Agg")  # headless
import matplotlib.pyplot as plt  # noqa: E402


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("json_path")
    p.add_argument("png_path")
    p.add_argument("--log-scale", action="store_true", help="log y axis on the left panel")
    args = p.parse_args(argv)
    with open(args.json_path) as f:
        data = json.load(f)

    names, fb, upd, floors, skipped = [], [], [], [], []
    for s in data["order"]:
        r = data["systems"].get(s)
        if r is None:
            continue
        m = r.get("median")
        if not m:
            skipped.append(f"{s}: {r.get('skipped', 'no data')}")
            continue
        names.append(f"{s}\n" + "\n".join(textwrap.wrap(r["label"], 18)))
        fb.append(m["fb_s"])
        # The rest of the iteration (data, logging) is folded into the update bar so bars = iteration time.
        upd.append(m["iteration_s"] - m["fb_s"])
        floors.append(r.get("floor", {}).get("update_floor_s"))

    totals = [f + u for f, u in zip(fb, upd)]
    # Right panel: zoomed to the second-largest bar, since DeepSpeed's NVMe step dwarfs the others.
    zoom = sorted(totals)[-2] * 1.3 if len(totals) > 1 else None
    fig, axes = plt.subplots(1, 2 if zoom else 1, figsize=(2 * max(6, 1.4 * len(names) + 2), 5), squeeze=False)
    for k, ax in enumerate(axes[0]):
        x = range(len(names))
        ax.bar(x, fb, label="forward + backward", color="#4c72b0")
        ax.bar(x, upd, bottom=fb, label="update (optimizer step)", color="#dd8452")
        for i, (f, u, fl) in enumerate(zip(fb, upd, floors)):
            ax.text(i, min(f + u, zoom or f + u) if k else f + u, f"{f + u:.2f}s", ha="center", va="bottom",
                    fontsize=8)
            if fl:
                ax.plot([i - 0.4, i + 0.4], [f + fl] * 2, color="black", linestyle="--", linewidth=1)
        ax.plot([], [], color="black", linestyle="--", linewidth=1, label="fwd+bwd + update floor")
        ax.set_xticks(list(x))
        ax.set_xticklabels(names, fontsize=7)
        ax.set_ylabel("seconds per iteration (median after warm-up)")
        if k:
            ax.set_ylim(0, zoom)
            ax.set_title("zoomed", fontsize=9)
        elif args.log_scale:
            ax.set_yscale("log")
    ax = axes[0][0]
    shape = data["shape"]
    ax.set_title(f"{shape['params'] / 1e9:.2f} G params, {shape['layers']}x{shape['hidden']}, seq {shape['seq']}, "
                 f"global batch {data['global_batch']}"
                 + (f", {data['nproc']} ranks sharing one disk" if data.get("nproc", 1) > 1 else ""), fontsize=9)
    ax.legend(fontsize=8)
    if skipped:
        fig.text(0.01, 0.01, "skipped: " + "; ".join(skipped), fontsize=6, wrap=True)
    fig.tight_layout(rect=(0, 0.04 if skipped else 0, 1, 1))
    fig.savefig(args.png_path, dpi=120)
    print(f"wrote {args.png_path}")


if __name__ == "__main__":
    main()
