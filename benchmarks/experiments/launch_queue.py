"""How many kernels the host may queue on a CUDA device before a launch blocks: times each launch of
N short sleeping kernels on one stream and prints where launches start to wait for the device.
(The deferred update queues its subgroups lazily because a step's ~2,000 launches blocked the host.)"""

import sys
import time

import torch

n = int(sys.argv[1]) if len(sys.argv) > 1 else 4000
cycles = int(sys.argv[2]) if len(sys.argv) > 2 else 200_000  # ~0.1 ms at ~2 GHz
torch.cuda.synchronize()
torch.cuda._sleep(cycles)
torch.cuda.synchronize()
times = []
t_all = time.perf_counter()
for _ in range(n):
    t0 = time.perf_counter()
    torch.cuda._sleep(cycles)
    times.append(time.perf_counter() - t0)
host_s = time.perf_counter() - t_all
torch.cuda.synchronize()
total_s = time.perf_counter() - t_all
blocked = next((k for k, t in enumerate(times) if t > 50e-6), None)
print(f"launch queue: {n} launches of a {cycles}-cycle sleep: host {host_s * 1e3:.1f} ms, device {total_s * 1e3:.1f} ms; "
      f"first launch over 50 us at #{blocked}; median launch {sorted(times)[n // 2] * 1e6:.1f} us, "
      f"over 50 us: {sum(t > 50e-6 for t in times)}")
