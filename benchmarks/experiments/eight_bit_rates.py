"""Rates of the 8-bit AdamW kernels on one param's worth of state in memory: the CPU's C++ one pass (fp32
master, and a remainders master merged and split in the pass), and on CUDA the Triton one; the torch path
beside them. G elements/s, best of 4 after a first call that builds and warms up.

    python3 benchmarks/experiments/eight_bit_rates.py [log2 elements, default 27]

Call 6 of 2026-11-27 ran this file's CUDA loop inline (1.34e8 elements, one H100): 88.5-95.4 G elements/s.
"""

import sys
import time

import torch

from mlp_offload.kernels import blockwise8 as b8
from mlp_offload.kernels.fused_update import AdamHyper
from mlp_offload.kernels.remainders import split

HYPER = AdamHyper(1e-3, 0.9, 0.95, 1e-8, 0.1)


def rate(step, device, n, remainders=False):
    layout = b8.BlockLayout.whole(n, 128)
    m, v = b8.shard_state(layout, b8.DEFAULT, device)
    master, grad = torch.randn(n, device=device), torch.randn(n, device=device) * 1e-3
    extra = {}
    if remainders:
        master, high = split(master)
        extra["high"] = high
    best = float("inf")
    for k in range(1, 6):
        if device == "cuda":
            torch.cuda.synchronize()
        started = time.perf_counter()
        step(master, grad, m, v, layout, HYPER, k, **extra)
        if device == "cuda":
            torch.cuda.synchronize()
        if k > 1:
            best = min(best, time.perf_counter() - started)
    return n / best / 1e9


def main():
    n = 1 << int(sys.argv[1]) if len(sys.argv) > 1 else 1 << 27
    from mlp_offload.kernels import blockwise8_cpu
    print(f"{n} elements, CPU {torch.get_num_threads()} threads")
    print(f"CPU C++ one pass, fp32 master: {rate(blockwise8_cpu.adamw_step, 'cpu', n):.3f} G elements/s")
    print(f"CPU C++ one pass, remainders master: {rate(blockwise8_cpu.adamw_step, 'cpu', n, True):.3f}")
    print(f"CPU torch path, fp32 master: {rate(b8.adamw_step, 'cpu', min(n, 1 << 22)):.3f}")
    if torch.cuda.is_available():
        from mlp_offload.kernels import blockwise8_device
        print(f"{torch.cuda.get_device_name()}: Triton one pass: {rate(blockwise8_device.adamw_step, 'cuda', n):.1f}")


if __name__ == "__main__":
    main()
