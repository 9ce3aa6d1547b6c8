"""Update-phase microbenchmark of the offload engine against its physical floor.

The floor's I/O part uses the probed rates: reads and writes one after the other, or, where the
probe saw the device overlap them, the measured mixed rate (TierBandwidth.seconds).

For each tier configuration it builds an engine over ``--numel`` fp32 parameters, runs a few
steps on bf16 gradients, and prints the steady-state update time beside:
  - the floor: max(Adam time, per-tier bytes moved / that tier's measured bandwidth), using the
    bytes the engine really moved and the bandwidths it probed;
  - the engine's own prediction from its performance model.

Example (CPU machine):
  python benchmarks/update_bench.py --numel 100000000 --subgroup-size 10000000 \
      --configs host nvme nvme+pfs --path nvme=/tmp/nvme --path pfs=/dev/shm/pfs --host-budget-gb 0.6
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from mlp_offload import OffloadConfig, OffloadedAdamW  # noqa: E402
from mlp_offload import device_seconds  # noqa: E402
from mlp_offload import AdamKernel, GiB, MiB  # noqa: E402


def parse_args():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--numel", type=float, default=1e8, help="parameters in the shard")
    p.add_argument("--subgroup-size", type=float, default=1e7)
    p.add_argument("--configs", nargs="+", default=["host", "nvme", "nvme+pfs"],
                   help="'+'-joined tier lists; a config with 'host' and files uses --host-budget-gb")
    p.add_argument("--path", action="append", default=[], metavar="TIER=DIR",
                   help="directory of a file tier (repeatable); tiers without one get a temp dir")
    p.add_argument("--host-budget-gb", type=float, default=None,
                   help="host budget for file configs (default: the pipeline minimum)")
    p.add_argument("--steps", type=int, default=4, help="steps per config; the first is not timed")
    p.add_argument("--prefetch-depth", type=int, default=2)
    p.add_argument("--io-threads", type=int, default=4)
    p.add_argument("--io-block-mb", type=int, default=8)
    p.add_argument("--probe-mb", type=int, default=1024)
    p.add_argument("--threads", type=int, default=None, help="torch CPU threads")
    p.add_argument("--json", default=None, help="also write the results here")
    return p.parse_args()


def adam_only_seconds(numel: int, subgroup: int) -> float:
    """Adam + grad conversion over the shard with all state in memory: the compute floor."""
    kernel = AdamKernel("fused")
    n = min(numel, subgroup)
    p, m, v, g32 = (torch.zeros(n) for _ in range(4))
    g = torch.randn(n).to(torch.bfloat16)
    kernel(p, g32, m, v, step=1)
    best = float("inf")
    for step in range(2, 5):
        start = time.perf_counter()
        g32.copy_(g)
        kernel(p, g32, m, v, step=step)
        best = min(best, time.perf_counter() - start)
    return best * numel / n


def run_config(name: str, args, numel: int) -> dict:
    tiers = name.split("+")
    paths = {}
    for t in tiers:
        if t != "host":
            given = dict(item.split("=", 1) for item in args.path)
            base = given.get(t) or tempfile.mkdtemp(prefix=f"bench-{t}-")
            os.makedirs(base, exist_ok=True)
            paths[t] = base
    budget = None
    if "host" in tiers and paths:
        budget = int(args.host_budget_gb * GiB)
    elif not paths:
        budget = None
    elif args.host_budget_gb is not None and "host" not in tiers:
        budget = int(args.host_budget_gb * GiB)
    cfg = OffloadConfig(tiers=tiers, paths=paths, host_budget_bytes=budget,
                        subgroup_size=int(args.subgroup_size), prefetch_depth=args.prefetch_depth,
                        io_threads=args.io_threads, io_block_bytes=args.io_block_mb * MiB,
                        probe_bytes=args.probe_mb * MiB, run_id=f"bench{os.getpid()}",
                        lock_dir=os.environ.get("MLP_OFFLOAD_LOCK_DIR") or None)
    t0 = time.perf_counter()
    engine = OffloadedAdamW(torch.zeros(numel), cfg, lr=1e-4, betas=(0.9, 0.95))
    setup_s = time.perf_counter() - t0
    engine.grad_buffer.copy_(torch.randn(min(numel, 1 << 24)).to(torch.bfloat16).repeat(numel // (1 << 24) + 1)[:numel])
    records = []
    try:
        for _ in range(args.steps):
            records.append(engine.step())
        rates = engine.rates
        prediction = engine.prediction.update_s
        placement = {t: engine.placement.tier_of.count(t) for t in ["host"] + cfg.file_tiers}
        slots, cache_slots = engine.placement.slots, engine.placement.cache_slots
        devices = engine.devices
    finally:
        engine.close()
    timed = records[1:] or records
    update = statistics.median(r.update_s for r in timed)
    # I/O floor from the bytes each tier really moved per step (reads prefetched before the step
    # and writes finished after it are in the records too) and the probed bandwidths.
    io_floor = 0.0
    per_tier = {}
    for t in cfg.file_tiers:
        rb = statistics.median(r.tiers[t].read_bytes for r in timed)
        wb = statistics.median(r.tiers[t].write_bytes for r in timed)
        floor_t = rates[t].seconds(rb, wb)  # the probe's fastest way to move that on this tier
        per_tier[t] = dict(read_gb=rb / 1e9, write_gb=wb / 1e9, read_gbps=rates[t].read_bps / 1e9,
                           write_gbps=rates[t].write_bps / 1e9, floor_s=floor_t,
                           measured_read_gbps=statistics.median(r.tiers[t].read_gbps for r in timed),
                           measured_write_gbps=statistics.median(r.tiers[t].write_gbps for r in timed))
    # Tiers on one device share it: their floors add up (device_seconds), the slowest device wins.
    io_floor = max(device_seconds({t: v["floor_s"] for t, v in per_tier.items()}, devices).values(), default=0.0)
    return dict(config=name, update_s=update, all_update_s=[r.update_s for r in records], setup_s=setup_s,
                predicted_s=prediction, io_floor_s=io_floor, placement=placement, slots=slots,
                cache_slots=cache_slots, cache_hits=timed[-1].cache_hits, tiers=per_tier,
                adam_s=statistics.median(r.adam_s for r in timed),
                convert_s=statistics.median(r.convert_s for r in timed),
                wait_s=statistics.median(r.read_wait_s for r in timed),
                line=timed[-1].line())


def main():
    args = parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    numel = int(args.numel)
    compute_floor = adam_only_seconds(numel, int(args.subgroup_size))
    print(f"# {numel / 1e9:.3f} G params, state {numel * 12 / 1e9:.2f} GB, subgroup {int(args.subgroup_size)}, "
          f"torch threads {torch.get_num_threads()}, cuda {torch.cuda.is_available()}")
    print(f"# compute floor (fused Adam + bf16->fp32, all in memory): {compute_floor:.3f} s")
    results = []
    for name in args.configs:
        res = run_config(name, args, numel)
        res["floor_s"] = max(compute_floor, res["io_floor_s"])
        results.append(res)
        print(f"## {name}: {res['line']}", flush=True)
    header = f"{'config':<14}{'update s':>10}{'floor s':>10}{'x floor':>9}{'pred s':>9}{'pred/meas':>10}  placement / tiers"
    print(header)
    for r in results:
        tiers = " ".join(
            f"{t}[r {v['read_gb']:.1f}GB w {v['write_gb']:.1f}GB probe {v['read_gbps']:.2f}/{v['write_gbps']:.2f} "
            f"seen {v['measured_read_gbps']:.2f}/{v['measured_write_gbps']:.2f} GB/s]"
            for t, v in r["tiers"].items())
        print(f"{r['config']:<14}{r['update_s']:>10.3f}{r['floor_s']:>10.3f}{r['update_s'] / r['floor_s']:>9.2f}"
              f"{r['predicted_s']:>9.3f}{r['predicted_s'] / r['update_s']:>10.2f}  {r['placement']} "
              f"slots {r['slots']} cache {r['cache_slots']} hits {r['cache_hits']} {tiers}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(numel=numel, compute_floor_s=compute_floor, results=results), f, indent=1)


if __name__ == "__main__":
    main()
