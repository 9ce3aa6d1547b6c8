"""Engine-only: one shard's update with the CPU (host state), on the GPU from streamed host state,
and on the GPU from device-resident state, for fp32 and bf16 moments side by side; the engine's
prediction beside each measured update. Gradients are bf16 on the device, as after backward.

  python benchmarks/experiments/device_update_rates.py --numel 2e9 --device cuda
  python benchmarks/experiments/device_update_rates.py --numel 2e6 --device cpu   (dry run)
"""

import argparse
import json
import time

import torch

from mlp_offload import ModelLink
from mlp_offload import OffloadConfig, OffloadedAdamW


class DeviceBf16Grads:
    """bf16 grads on the device: cast there; copied to the host for the CPU's subgroups."""

    def __init__(self, grads):
        self.grads, self.events = grads, {}

    def start(self, start, end, out, unscale, clip):
        out.copy_(self.grads[start:end], non_blocking=True)
        self.events[start] = torch.cuda.Event() if self.grads.is_cuda else None
        if self.events[start] is not None:
            self.events[start].record()

    def wait(self, start):
        event = self.events.pop(start)
        if event is not None:
            event.synchronize()

    def to_device(self, start, end, out, unscale, clip):
        out.copy_(self.grads[start:end])


def run(kind, moments, args):
    numel = int(args.numel)
    dtypes = ("fp32", moments, moments)
    budget = int(numel * (4 + 2 * (4 if moments == "fp32" else 2)) * 1.05) + (64 << 20)
    tiers = {"cpu": ["host"], "stream": ["host"], "resident": ["gpu", "host"], "auto": ["host"]}[kind]
    cfg = OffloadConfig(tiers=tiers, subgroup_size=int(args.subgroup_size), state_dtypes=dtypes,
                        device=args.device, update_on={"cpu": "cpu", "stream": "device", "resident": "cpu",
                                                       "auto": "auto"}[kind],
                        gpu_budget_bytes=budget if kind == "resident" else None,
                        adam_kernel="fused" if args.device == "cuda" else "single")
    grads = (torch.randn(numel, device=args.device) * 1e-3).to(torch.bfloat16)
    eng = OffloadedAdamW(lambda s, e, out: out.fill_(0.01), cfg, numel=numel,
                         model=ModelLink(grad_source=DeviceBf16Grads(grads)))
    times = []
    try:
        for _ in range(args.steps):
            t = time.perf_counter()
            rec = eng.step()
            if args.device == "cuda":
                torch.cuda.synchronize()
            times.append(time.perf_counter() - t)
        result = dict(kind=kind, moments=moments, numel=numel, seconds=times[1:] or times,
                      predicted=eng.prediction.update_s, line=rec.line(),
                      placement=eng.prediction.describe())
    finally:
        eng.close()
    best = min(result["seconds"])
    print(f"{kind:9s} {moments:5s} moments: {best:.3f} s per update ({numel / best / 1e9:.2f} G params/s), "
          f"predicted {result['predicted']:.3f} s | {result['line']}", flush=True)
    return result


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--numel", type=float, default=2e9)
    p.add_argument("--subgroup-size", type=float, default=1e8)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--kinds", nargs="+", default=["cpu", "stream", "resident", "auto"])
    p.add_argument("--json", default=None)
    args = p.parse_args()
    results = [run(kind, moments, args) for moments in ("bf16", "fp32") for kind in args.kinds]
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
