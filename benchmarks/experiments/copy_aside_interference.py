"""What a background thread's copy of memory-held state costs the training steps beside it, copy by copy.

A paced --async-save copies the state held in memory aside before its first chunk (``StateSnapshot.stage_ahead``):
the gpu tier's subgroups into fresh host buffers (device to host), the host tier's into others (host to host).
This times a stand-in for the forward and backward (a stack of bf16 linear layers, forward and backward,
launched from the main thread) alone, then beside each way of making such a copy in a thread, and prints
each one's slowdown of those steps and its own copy rate.

    python benchmarks/experiments/copy_aside_interference.py [--gib 4] [--device cuda]
    (device tool: bash benchmarks/run_gpu.sh copy_aside_interference -- via its .sh; CPU dry run: --device cpu --gib 0.1)
"""

from __future__ import annotations

import argparse
import mmap
import os
import threading
import time

import torch

CHUNK = 600 * 2 ** 20  # about one subgroup of 100 M elements of fp32 master and fp8 moments


def aligned_empty(nbytes: int) -> torch.Tensor:
    """Fresh anonymous pages left out of forked children, as the snapshot's staging buffers are."""
    region = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    region.madvise(mmap.MADV_DONTFORK)
    return torch.frombuffer(region, dtype=torch.uint8)


def make_steps(device: str, width: int, layers: int, tokens: int):
    weights = [torch.randn(width, width, device=device, dtype=torch.bfloat16, requires_grad=True)
               for _ in range(layers)]
    x = torch.randn(tokens, width, device=device, dtype=torch.bfloat16)

    def step():
        h = x
        for w in weights:
            h = torch.nn.functional.silu(h @ w) + h
        h.float().pow(2).mean().backward()
        if device == "cuda":
            torch.cuda.synchronize()
    return step


def copy_fresh(src: torch.Tensor, stream) -> None:
    """As the snapshot does today: a fresh never-forked host buffer per chunk, copied into in place."""
    for start in range(0, src.numel(), CHUNK):
        piece = src[start:start + CHUNK]
        dst = aligned_empty(piece.numel())
        with torch.cuda.stream(stream) if stream is not None else _nothing():
            dst.copy_(piece)
    if stream is not None:
        stream.synchronize()


def copy_into(dsts, src: torch.Tensor, stream, non_blocking: bool = False) -> None:
    for dst, start in zip(dsts, range(0, src.numel(), CHUNK)):
        with torch.cuda.stream(stream) if stream is not None else _nothing():
            dst.copy_(src[start:start + CHUNK], non_blocking=non_blocking)
    if stream is not None:
        stream.synchronize()


def copy_bounced(src: torch.Tensor, stream, bounce_bytes: int = 64 * 2 ** 20) -> None:
    """Device to fresh pageable buffers through two pinned bounce buffers: the DMA only ever touches pinned
    memory, the page faults of the fresh buffers are the CPU's alone."""
    bounces = [torch.empty(bounce_bytes, dtype=torch.uint8, pin_memory=True) for _ in range(2)]
    events = [torch.cuda.Event(), torch.cuda.Event()]
    for start in range(0, src.numel(), CHUNK):
        piece = src[start:start + CHUNK]
        dst = aligned_empty(piece.numel())
        offsets = list(range(0, piece.numel(), bounce_bytes))
        for k, off in enumerate(offsets):
            b, e = bounces[k % 2], events[k % 2]
            n = min(bounce_bytes, piece.numel() - off)
            with torch.cuda.stream(stream):
                b[:n].copy_(piece[off:off + n], non_blocking=True)
                e.record(stream)
            e.synchronize()
            dst[off:off + n].copy_(b[:n])


class _nothing:
    def __enter__(self):
        return self

    def __exit__(self, *a):
        return False


def timed_beside(step, work, warm_steps: int = 3):
    """Steps run while ``work`` runs in a thread: (mean step s, work s)."""
    for _ in range(warm_steps):
        step()
    done, took = threading.Event(), [0.0]

    def run():
        started = time.perf_counter()
        work()
        took[0] = time.perf_counter() - started
        done.set()
    thread = threading.Thread(target=run)
    times = []
    thread.start()
    while not done.is_set():
        started = time.perf_counter()
        step()
        times.append(time.perf_counter() - started)
    thread.join()
    return sum(times) / len(times), took[0], len(times)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--gib", type=float, default=4.0)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--width", type=int, default=3072)
    ap.add_argument("--layers", type=int, default=28)
    ap.add_argument("--tokens", type=int, default=2048)
    args = ap.parse_args()
    cuda = args.device == "cuda"
    nbytes = int(args.gib * 2 ** 30)
    step = make_steps(args.device, args.width, args.layers, args.tokens)
    for _ in range(5):
        step()
    started = time.perf_counter()
    for _ in range(20):
        step()
    alone = (time.perf_counter() - started) / 20
    print(f"steps alone: {alone * 1e3:.1f} ms (torch threads {torch.get_num_threads()}, {os.cpu_count()} CPUs)")
    host_src = torch.ones(nbytes, dtype=torch.uint8)
    chunks = (nbytes + CHUNK - 1) // CHUNK

    def touched():
        return [aligned_empty(min(CHUNK, nbytes - k * CHUNK)).fill_(0) for k in range(chunks)]

    cases = [("host to fresh host (the host tier's copy today)", lambda: copy_fresh(host_src, None)),
             ("fresh host buffers faulted in, no copy", lambda: touched())]
    pre_touched = touched()
    cases.append(("host to faulted-in host", lambda: copy_into(pre_touched, host_src, None)))
    if cuda:
        dev_src = torch.ones(nbytes, dtype=torch.uint8, device="cuda")
        stream = torch.cuda.Stream()
        pinned = [torch.empty(d.numel(), dtype=torch.uint8, pin_memory=True) for d in pre_touched]
        cases = [("device to fresh host (the gpu tier's copy today)", lambda: copy_fresh(dev_src, stream)),
                 ("device to faulted-in host", lambda: copy_into(pre_touched, dev_src, stream)),
                 ("device to pinned host", lambda: copy_into(pinned, dev_src, stream, non_blocking=True)),
                 ("device to fresh host through pinned bounce buffers", lambda: copy_bounced(dev_src, stream)),
                 ("device to device", lambda: dev_src.clone() is not None and torch.cuda.synchronize())] + cases
    threads = torch.get_num_threads()
    for name, work in cases:
        for label, n in (("", threads), (", the copier's torch threads 1", 1)) if "host to" in name else (("", threads),):
            torch.set_num_threads(n)
            mean, took, count = timed_beside(step, work)
            torch.set_num_threads(threads)
            print(f"{name}{label}: steps {mean * 1e3:.1f} ms = {mean / alone:.2f}x alone over {count} steps; "
                  f"the copy {args.gib:.2f} GiB in {took:.2f} s ({nbytes / took / 1e9:.2f} GB/s)", flush=True)


if __name__ == "__main__":
    main()
