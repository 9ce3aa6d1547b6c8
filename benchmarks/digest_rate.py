"""The resume check's digest rate (mlp_offload.checkpoint.digest): GB/s over a tensor of each stored
dtype, on the CPU (one thread: the writer's or the fill's) and on the GPU where there is one. A save
adds it to the writer's thread (beside its writes), a load to the fill; compare with the disk's
rates (benchmarks/io_floor.py).

    python benchmarks/digest_rate.py [--gb 1]
"""

import argparse
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from mlp_offload.checkpoint import tensor_digest  # noqa: E402


def rate(t: torch.Tensor, repeats: int = 3) -> float:
    best = float("inf")
    for _ in range(repeats):
        if t.is_cuda:
            torch.cuda.synchronize()
        started = time.perf_counter()
        tensor_digest(t).tolist()
        best = min(best, time.perf_counter() - started)
    return t.numel() * t.element_size() / best / 1e9


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--gb", type=float, default=1.0, help="size of each tensor digested")
    args = parser.parse_args()
    n = int(args.gb * 1e9)
    raw = torch.randint(0, 256, (n,), dtype=torch.uint8)
    print(f"torch threads {torch.get_num_threads()}, {os.cpu_count()} CPUs", flush=True)
    for dtype in (torch.float32, torch.bfloat16, torch.uint8):
        t = raw[: n // dtype.itemsize * dtype.itemsize].view(dtype)
        line = f"{str(dtype):15s} | cpu {rate(t):5.2f} | cpu, unaligned {rate(t[1:]):5.2f}"
        if torch.cuda.is_available():
            on_gpu = t[1:].cuda()  # from an odd element: the words' lanes too
            same = tensor_digest(on_gpu, 5).tolist() == tensor_digest(t[1:], 5).tolist()
            line += f" | {torch.cuda.get_device_name()} {rate(on_gpu):7.1f} (digest as the CPU's: {same})"
        print(line + " GB/s", flush=True)


if __name__ == "__main__":
    main()
