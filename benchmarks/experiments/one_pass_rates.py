"""Update rates, multi-pass against one pass, per stored-state dtype set: on the CPU (this machine's
threads), and on CUDA where there is a device (state resident in device memory, and pinned host state
streamed through it, copies overlapped), as the engine times them (mlp_offload.measure_update_paths).
  python benchmarks/experiments/one_pass_rates.py [numel]"""

import sys

import torch

from mlp_offload import measure_update_paths

SETS = {"rem16/bf16/bf16": (torch.int16, torch.bfloat16, torch.bfloat16),
        "rem16/fp32/fp32": (torch.int16, torch.float32, torch.float32),
        "fp32/fp32/fp32": (torch.float32, torch.float32, torch.float32)}


def main():
    numel = int(float(sys.argv[1])) if len(sys.argv) > 1 else 100_000_000
    if not torch.cuda.is_available():
        print("one_pass_rates: no CUDA device here; CPU rates only")
    for name, dtypes in SETS.items():
        print(f"{name}: {measure_update_paths(dtypes, numel).describe(torch.get_num_threads())}", flush=True)


if __name__ == "__main__":
    main()
