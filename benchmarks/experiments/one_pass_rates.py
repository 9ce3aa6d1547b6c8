"""Update rates, multi-pass against one pass, per set of stored-state formats: on the CPU (this machine's
threads), and on CUDA where there is a device (state resident in device memory, and pinned host state
streamed through it, copies overlapped), as the engine times them (mlp_offload.measure_update_paths).
  python benchmarks/experiments/one_pass_rates.py [numel]"""

import sys

import torch

from mlp_offload import codecs_for, measure_update_paths

SETS = ("rem16/bf16/bf16", "rem16/fp32/fp32", "fp32/fp32/fp32")


def main():
    numel = int(float(sys.argv[1])) if len(sys.argv) > 1 else 100_000_000
    if not torch.cuda.is_available():
        print("one_pass_rates: no CUDA device here; CPU rates only")
    for name in SETS:
        rates = measure_update_paths(codecs_for(name.split("/")), numel)
        print(f"{name}: {rates.describe(torch.get_num_threads())}", flush=True)


if __name__ == "__main__":
    main()
