"""Engine-only: where a step's device update of state held in HBM spends its time beyond the kernel, on the
10.24 B Llama's flat layout (36 layers of fc2, fc1, norm, proj, qkv, norm in DDP's order; norms without weight
decay, a param group of their own): the step's wall time, the kernels' own time and count (torch.profiler),
and the kernel alone over the same elements in one group.

  python benchmarks/experiments/update_overhead.py                  (on the GPU machine)
  python benchmarks/experiments/update_overhead.py --scale 1e-4 --device cpu   (dry run)
"""

import argparse
import statistics
import time

import torch

from mlp_offload import ModelLink
from mlp_offload import OffloadConfig, OffloadedAdamW

HIDDEN, FFN, KV, LAYERS, VOCAB = 5120, 13824, 1024, 36, 32000


def llama_10b_layout(scale: float):
    """(numel, decay ranges, no-decay ranges) of the 10.24 B shape's flat shard (sizes times ``scale``)."""
    n = lambda x: max(1, int(x * scale))  # noqa: E731
    decay, plain, at = [], [], 0

    def put(size, ranges):
        nonlocal at
        ranges.append((at, at + size))
        at += size
    put(n(VOCAB * HIDDEN), decay)  # output layer
    put(n(HIDDEN), plain)  # final norm
    for _ in range(LAYERS):
        put(n(FFN * HIDDEN), decay)
        put(n(2 * FFN * HIDDEN), decay)
        put(n(HIDDEN), plain)
        put(n(HIDDEN * HIDDEN), decay)
        put(n(HIDDEN * (HIDDEN + 2 * KV)), decay)
        put(n(HIDDEN), plain)
    put(n(VOCAB * HIDDEN), decay)  # embedding
    return at, decay, plain


class Flat:
    """A flat device tensor as the engine's grad or param source (``views``)."""

    def __init__(self, tensor, zero=False):
        self.buffer, self.zero_after_read = tensor, zero

    def views(self, start, end):
        yield start, end, self.buffer[start:end]

    def to_device(self, start, end, out, *scales):
        out.copy_(self.buffer[start:end])
        for factor in scales:
            if factor is not None and factor != 1.0:
                out.mul_(factor)

    def fill(self, start, end, out):
        out.copy_(self.buffer[start:end])


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--scale", type=float, default=1.0)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--steps", type=int, default=6)
    args = p.parse_args()
    dev, cuda = args.device, args.device == "cuda"
    numel, decay, plain = llama_10b_layout(args.scale)
    sub = max(1000, int(1e8 * args.scale))
    cfg = OffloadConfig(tiers=["gpu"], subgroup_size=sub, state_dtypes=("fp32", "bf16", "bf16"), device=dev,
                        update_on="device", gpu_budget_bytes=numel * 6 + (1 << 30), param_remainders=True,
                        adam_kernel="fused" if cuda else "single")
    grads = torch.full((numel,), 1e-3, dtype=torch.bfloat16, device=dev)
    params = torch.full((numel,), 0.01, dtype=torch.bfloat16, device=dev)
    source = Flat(params)
    eng = OffloadedAdamW(source.fill, cfg, numel=numel,
                         groups=[(decay, {}), (plain, {"weight_decay": 0.0})], weight_decay=0.1,
                         model=ModelLink(grad_source=Flat(grads), param_high=source,
                                         on_params_updated=lambda s, e, out: params[s:e].copy_(out)))
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    times = []
    for _ in range(args.steps):
        sync()
        t = time.perf_counter()
        eng.step(clip_coef=0.5)
        sync()
        times.append(time.perf_counter() - t)
    print(f"{numel / 1e9:.2f} G elements, {len(eng.subgroups)} subgroups, on the model's buffers: "
          f"{eng.update_paths.on_model_buffers}; step {statistics.median(times[1:]) * 1e3:.1f} ms "
          f"(min {min(times[1:]) * 1e3:.1f}); engine's predicted update {eng.prediction.update_s * 1e3:.1f} ms", flush=True)
    if cuda:
        from torch.profiler import ProfilerActivity, profile
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            sync()
            t = time.perf_counter()
            eng.step(clip_coef=0.5)
            sync()
            wall = time.perf_counter() - t
        kernels = [e for e in prof.events() if e.device_type.name == "CUDA"]
        adam = [e for e in kernels if "adamw" in e.name]
        busy = sum(e.device_time for e in kernels) / 1e3
        first = min(e.time_range.start for e in kernels) / 1e3
        last = max(e.time_range.end for e in kernels) / 1e3
        print(f"profiled step {wall * 1e3:.1f} ms: {len(kernels)} kernels ({len(adam)} AdamW) busy "
              f"{busy:.1f} ms (AdamW {sum(e.device_time for e in adam) / 1e3:.1f}), first to last kernel "
              f"{last - first:.1f} ms", flush=True)
        print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=14), flush=True)
    eng.close()


if __name__ == "__main__":
    main()
