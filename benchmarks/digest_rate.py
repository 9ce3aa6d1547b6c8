"""The resume check's digest rate (mlp_offload.checkpoint.digest): GB/s over a tensor of each stored
dtype, on the CPU (one thread: the writer's or the fill's) and on the GPU where there is one. A save
adds it to the writer's thread (beside its writes), a load to the fill; compare with the disk's
rates (benchmarks/io_floor.py). With ``--beside-training S``: what a digest on its own thread, as the
checkpoint writer's runs beside training, costs a thread making small torch calls as a training step's Python
does (each leaves the GIL), over S seconds alone and S beside it: that thread's calls per second and its
voluntary context switches (each a time it waited for the GIL back).

    python benchmarks/digest_rate.py [--gb 1] [--beside-training 3]
"""

import argparse
import os
import sys
import threading
import time
from typing import Callable

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


def voluntary_switches() -> int:
    with open(f"/proc/self/task/{threading.get_native_id()}/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("voluntary_ctxt_switches"))


def small_calls(done: Callable[[], bool]):
    """(torch calls a second, voluntary switches) of this thread making small calls until ``done()``."""
    x, calls, started, switched = torch.ones(64), 0, time.perf_counter(), voluntary_switches()
    while not done():
        for _ in range(100):
            x = x.add(1.0).mul_(0.5)
        calls += 200
    return calls / (time.perf_counter() - started), voluntary_switches() - switched


def for_seconds(seconds: float) -> Callable[[], bool]:
    deadline = time.perf_counter() + seconds
    return lambda: time.perf_counter() >= deadline


def beside_training(t: torch.Tensor, seconds: float) -> None:
    alone = small_calls(for_seconds(seconds))
    stop, digested = threading.Event(), [0]

    def digest_over_and_over():
        while not stop.is_set():
            tensor_digest(t)
            digested[0] += 1

    thread = threading.Thread(target=digest_over_and_over)
    thread.start()
    time.sleep(0.3)
    first, started = digested[0], time.perf_counter()
    beside = small_calls(for_seconds(seconds))
    gbps = (digested[0] - first) * t.numel() * t.element_size() / (time.perf_counter() - started) / 1e9
    stop.set()
    thread.join()
    print(f"small torch calls: {alone[0]:.0f}/s alone ({alone[1]} voluntary switches in {seconds:g} s), {beside[0]:.0f}/s "
          f"beside a digest on its own thread ({beside[1]} switches): {alone[0] / beside[0]:.2f}x slower; the digest "
          f"{gbps:.2f} GB/s meanwhile ({str(t.dtype)}, {t.numel() * t.element_size() / 1e9:.2f} GB over and over)")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--gb", type=float, default=1.0, help="size of each tensor digested")
    parser.add_argument("--beside-training", type=float, default=0.0, metavar="S",
                        help="also time small torch calls for S seconds alone and S beside a digest's thread")
    args = parser.parse_args()
    n = int(args.gb * 1e9)
    raw = torch.randint(0, 256, (n,), dtype=torch.uint8)
    if args.beside_training:
        torch.set_num_threads(1)  # the digest's own work is one thread's; the calls' too
        beside_training(raw[: n // 4 * 4].view(torch.float32), args.beside_training)
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
