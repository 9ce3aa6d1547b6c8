"""The GPU's streams over a torch.profiler window (a chrome trace from pretrain_gpt.py --profile with
--tensorboard-dir): how long the host link was busy each way, the kernels' busy time, and the longest
stretches where the link idled one way, with what ran meanwhile. Where an offloaded update's copies
wait, this shows it.
    python3 benchmarks/experiments/stream_timeline.py TRACE.json [ITERATIONS]"""

import json
import sys


def union(intervals):
    """Total length and the merged list of (start, end) intervals."""
    merged = []
    for start, end in sorted(intervals):
        if merged and start <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], end)
        else:
            merged.append([start, end])
    return sum(e - s for s, e in merged), merged


def gaps(merged, lo, hi):
    out, at = [], lo
    for s, e in merged:
        if s > at:
            out.append((at, s))
        at = max(at, e)
    if hi > at:
        out.append((at, hi))
    return out


def main(path, iterations=1):
    events = [e for e in json.load(open(path))["traceEvents"] if e.get("ph") == "X" and "dur" in e]
    gpu = [e for e in events if e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset")]
    if not gpu:
        print(f"{path}: no GPU events (a CPU run)")
        return
    lo = min(e["ts"] for e in gpu)
    hi = max(e["ts"] + e["dur"] for e in gpu)
    span = (hi - lo) / 1e6
    kinds = {"HtoD": [], "DtoH": [], "kernel": []}
    moved = {"HtoD": 0, "DtoH": 0}
    for e in gpu:
        iv = (e["ts"], e["ts"] + e["dur"])
        if e["cat"] == "kernel":
            kinds["kernel"].append(iv)
        for way in ("HtoD", "DtoH"):
            if e["cat"] == "gpu_memcpy" and way in e["name"]:
                kinds[way].append(iv)
                moved[way] += e.get("args", {}).get("bytes", 0)
    print(f"{path}: window {span:.3f} s ({span / iterations:.3f} s per iteration over {iterations})")
    merged = {}
    for kind, ivs in kinds.items():
        busy, merged[kind] = union(ivs)
        extra = ""
        if kind in moved and busy:
            extra = f", {moved[kind] / 1e9:.2f} GB at {moved[kind] / (busy / 1e6) / 1e9:.1f} GB/s while busy"
        print(f"  {kind:6s} busy {busy / 1e6:.3f} s ({100 * busy / (hi - lo):.0f}%){extra}")
    both, _ = union([iv for iv in merged["HtoD"]] + [iv for iv in merged["DtoH"]])
    print(f"  link busy either way {both / 1e6:.3f} s; idle both ways {span - both / 1e6:.3f} s")
    for way in ("HtoD", "DtoH"):
        long = sorted(gaps(merged[way], lo, hi), key=lambda g: g[0] - g[1])[:6]
        for s, e in sorted(long):
            kernel_busy, _ = union([(max(a, s), min(b, e)) for a, b in merged["kernel"] if a < e and b > s])
            other = "DtoH" if way == "HtoD" else "HtoD"
            other_busy, _ = union([(max(a, s), min(b, e)) for a, b in merged[other] if a < e and b > s])
            print(f"  {way} idle {(s - lo) / 1e6:7.3f}-{(e - lo) / 1e6:7.3f} s ({(e - s) / 1e3:6.1f} ms): "
                  f"kernels {100 * kernel_busy / max(e - s, 1):.0f}%, {other} {100 * other_busy / max(e - s, 1):.0f}%")


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]) if len(sys.argv) > 2 else 1)
