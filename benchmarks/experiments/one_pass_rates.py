"""Device update rates, multi-pass against the one-pass kernel, per stored-state dtype set: elements/s
on state resident in device memory and on pinned host state streamed through the device (copies
overlapped), as the engine measures them at start-up (plan.rates.measure_device_rates); and the CPU
update, multi-pass against its one-pass kernel (cpu_one_pass), as plan.rates.measure_cpu_update_rate
measures it, at torch's CPU thread count.
  python benchmarks/experiments/one_pass_rates.py [numel]      (the device part needs CUDA)"""

import sys

import torch

from mlp_offload.device_update import DeviceUpdate
from mlp_offload.fused_update import verified_fused_update
from mlp_offload.cpu_one_pass import verified_cpu_one_pass
from mlp_offload.plan.rates import measure_cpu_update_rate, measure_device_rates
from mlp_offload.update import AdamKernel

SETS = {"rem16/bf16/bf16": (torch.int16, torch.bfloat16, torch.bfloat16),
        "rem16/fp32/fp32": (torch.int16, torch.float32, torch.float32),
        "fp32/fp32/fp32": (torch.float32, torch.float32, torch.float32)}


def cpu_rates(numel: int) -> None:
    kernel = AdamKernel("single")
    step = lambda p, g, m, v, step: kernel(p, g, m, v, step=step)  # noqa: E731
    for name, dtypes in SETS.items():
        multi = measure_cpu_update_rate(step, dtypes, numel, repeats=2)
        one_pass, how = verified_cpu_one_pass(dtypes, kernel)
        one = measure_cpu_update_rate(step, dtypes, numel, repeats=2, one_pass=one_pass) if one_pass else float("nan")
        print(f"{name}: CPU ({torch.get_num_threads()} threads) multi-pass {multi / 1e9:.3f} G elem/s; "
              f"one pass {one / 1e9:.3f} ({how})", flush=True)


def main():
    numel = int(float(sys.argv[1])) if len(sys.argv) > 1 else 100_000_000
    cpu_rates(numel)
    if not torch.cuda.is_available():
        print("one_pass_rates: no CUDA device here; device rates not measured")
        return
    kernel = AdamKernel("foreach")
    for name, dtypes in SETS.items():
        updater = DeviceUpdate("cuda", dtypes, numel, numel)
        multi = measure_device_rates(updater, lambda p, g, m, v, step: kernel(p, g, m, v, step=step), dtypes, numel)
        updater.fused, how = verified_fused_update("cuda", dtypes, kernel)
        one = measure_device_rates(updater, lambda p, g, m, v, step: kernel(p, g, m, v, step=step), dtypes, numel) \
            if updater.fused is not None else (float("nan"), float("nan"))
        print(f"{name}: multi-pass resident {multi[0] / 1e9:.2f} G elem/s, streamed {multi[1] / 1e9:.2f}; "
              f"one pass resident {one[0] / 1e9:.2f}, streamed {one[1] / 1e9:.2f} ({how})", flush=True)
        del updater
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
