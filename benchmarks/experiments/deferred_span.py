"""Engine-only: the device update of state held in HBM, in series and deferred (``defer_device_wait``,
as --offload-overlap-forward runs it, settled at once), with the one-pass kernel on the model's own
buffers or through copies, grads zeroed as read or not. Why a deferred step's device work could take
longer than the same work in series.

  python benchmarks/experiments/deferred_span.py --numel 2e9
  python benchmarks/experiments/deferred_span.py --numel 2e6 --device cpu   (dry run)
"""

import argparse
import statistics
import time

import torch

from mlp_offload import ModelLink
from mlp_offload import OffloadConfig, OffloadedAdamW


class ModelGrads:
    """The model's bf16 grads on the device: the engine's gradient source (with ``views``)."""

    def __init__(self, grads, zero):
        self.buffer, self.zero_after_read = grads, zero

    def views(self, start, end):
        yield start, end, self.buffer[start:end]

    def to_device(self, start, end, out, unscale, clip):
        out.copy_(self.buffer[start:end])
        for factor in (unscale, clip):
            if factor is not None and factor != 1.0:
                out.mul_(factor)
        if self.zero_after_read:
            self.buffer[start:end].zero_()


class ModelParams:
    """The model's bf16 params on the device: the engine's param-high source (with ``views``)."""

    def __init__(self, params):
        self.params = params

    def views(self, start, end):
        yield start, end, self.params[start:end]

    def fill(self, start, end, out):
        out.copy_(self.params[start:end])

    to_device = fill


def run(defer, zero, model, args):
    numel, dev = int(args.numel), args.device
    cfg = OffloadConfig(tiers=["gpu"], subgroup_size=int(args.subgroup_size), state_dtypes=("fp32", "bf16", "bf16"),
                        device=dev, update_on="device", gpu_budget_bytes=numel * 6 + (1 << 30),
                        param_remainders=True, defer_device_wait=defer, device_model_buffers=model,
                        adam_kernel="fused" if dev == "cuda" else "single")
    grads = torch.zeros(numel, dtype=torch.bfloat16, device=dev)
    params = torch.full((numel,), 0.01, dtype=torch.bfloat16, device=dev)
    source = ModelParams(params)

    def on_params(start, end, out):
        params[start:end].copy_(out)
    eng = OffloadedAdamW(params, cfg, numel=numel,
                         model=ModelLink(grad_source=ModelGrads(grads, zero), param_high=source,
                                         on_params_updated=on_params))
    times = []
    try:
        for _ in range(args.steps):
            grads.normal_(0, 1e-3)
            if dev == "cuda":
                torch.cuda.synchronize()
            t = time.perf_counter()
            eng.step(clip_coef=0.5)
            if defer:
                eng.settle()
            if dev == "cuda":
                torch.cuda.synchronize()
            times.append(time.perf_counter() - t)
        how = eng.update_paths.on_model_buffers
    finally:
        eng.close()
    ms = statistics.median(times[1:]) * 1e3
    print(f"defer {defer!s:5} zero {zero!s:5} model buffers {how!s:5}: {ms:7.1f} ms per step "
          f"({numel / ms / 1e6:.1f} G elem/s)", flush=True)


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--numel", type=float, default=2e9)
    p.add_argument("--subgroup-size", type=float, default=1e8)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--steps", type=int, default=5)
    args = p.parse_args()
    for model in (True, False):
        for defer in (False, True):
            for zero in (False, True):
                run(defer, zero, model, args)


if __name__ == "__main__":
    main()
