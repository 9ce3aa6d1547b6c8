"""Whether a checkpoint writer slows the forward and backward passes beside it more from threads of the training
process than from a process of its own, with the same work: a model's steps timed in phases.

    python benchmarks/experiments/writer_beside_steps.py DIR [--gb 8] [--steps 6]
        [--phases none,thread,process,thread_nocopy,thread_dma,none,process,thread]
        [--layers 28 --hidden 3072 --ffn 8192 --seq 2048] [--micro 8] [--device cuda]

A step is ``--micro`` forwards and backwards of a stack of pre-norm transformer blocks in bf16 (each block
recomputed in the backward, as --recompute-granularity full does), then a device synchronize: no optimizer and no
disk I/O of its own, so every step is a quiet spell for the writer. The writer streams ``--gb`` of host memory into
a file in ``DIR`` with the work the offloaded state's checkpoint writer does per piece (its ``DirectRegionWriter``,
an inside of the engine this script does not import): each 16 MiB piece copied into a page-aligned ring of 8, its
CRC32 on a thread of its own, written by one of 8 threads by O_DIRECT where the file system has it; round after
round until its phase ends. Phases: ``none`` (no writer), ``thread`` (the writer in this process, started at the
phase's start), ``process`` (the same writer in a child forked at the phase's start, which touches no device);
and, in a thread, ``thread_nocopy`` (no ring: each piece's CRC taken and its write made from the source itself) and
``thread_dma`` (the writes alone, from the source). Each phase's steps against the first ``none`` phase's median,
and what the writer moved: a writer that slows the steps as much from its process as from a thread does so through
what the two share (cores, caches, memory), not through the interpreter's lock; the last two say which of its work
does.
"""

from __future__ import annotations

import argparse
import mmap
import os
import sys
import threading
import time
import zlib
from concurrent.futures import ThreadPoolExecutor
from typing import List, Optional

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from disk_sustain import open_file, phase_summary  # this script's directory, as when run beside it

PHASES = ("none", "thread", "process", "thread_nocopy", "thread_dma")
PIECE = 16 << 20  # the checkpoint writer's piece
RING = 8  # its staging buffers in flight
WRITE_THREADS = 8


class Block(torch.nn.Module):
    def __init__(self, hidden: int, ffn: int, heads: int):
        super().__init__()
        self.heads = heads
        self.norm1, self.norm2 = torch.nn.RMSNorm(hidden), torch.nn.RMSNorm(hidden)
        self.qkv = torch.nn.Linear(hidden, 3 * hidden, bias=False)
        self.proj = torch.nn.Linear(hidden, hidden, bias=False)
        self.up = torch.nn.Linear(hidden, 2 * ffn, bias=False)
        self.down = torch.nn.Linear(ffn, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, h = x.shape
        q, k, v = self.qkv(self.norm1(x)).view(b, s, 3, self.heads, h // self.heads).permute(2, 0, 3, 1, 4)
        x = x + self.proj(F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, s, h))
        gate, up = self.up(self.norm2(x)).chunk(2, dim=-1)
        return x + self.down(F.silu(gate) * up)


def step(blocks: List[Block], inputs: torch.Tensor, micro: int, device: torch.device) -> float:
    started = time.perf_counter()
    for _ in range(micro):
        x = inputs.requires_grad_(True)
        for block in blocks:
            x = checkpoint(block, x, use_reentrant=False)
        x.float().pow(2).mean().backward()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter() - started


class Writer:
    """Rounds of ``source`` written into ``path`` until ``stop`` is set (a piece at least). ``copy``: each piece
    copied into the ring first, as the checkpoint writer does (else written from the source itself, which is
    page-aligned); ``crc``: its CRC32 taken."""

    def __init__(self, source: torch.Tensor, path: str):
        self.source, self.path = source, path

    def run(self, stop: threading.Event, moved: Optional[List[int]] = None, copy: bool = True,
            crc: bool = True) -> int:
        fd, _ = open_file(self.path, self.source.numel())
        ring = [mmap.mmap(-1, PIECE) for _ in range(RING)] if copy else []  # page-aligned: fit for O_DIRECT
        staged = [torch.frombuffer(buffer, dtype=torch.uint8) for buffer in ring]
        whole = memoryview(self.source.numpy())
        in_flight: List[list] = [[] for _ in range(RING)]
        done, k = 0, 0
        try:
            with ThreadPoolExecutor(WRITE_THREADS) as writes, ThreadPoolExecutor(1) as crcs:
                while done == 0 or not stop.is_set():
                    for lo in range(0, self.source.numel(), PIECE):
                        k = (k + 1) % RING
                        for future in in_flight[k]:
                            future.result()  # the buffer is free once its CRC and its write have read it
                        if copy:
                            staged[k].copy_(self.source[lo: lo + PIECE])
                        piece = ring[k] if copy else whole[lo: lo + PIECE]
                        in_flight[k] = ([crcs.submit(zlib.crc32, piece)] if crc else []) + [
                            writes.submit(os.pwrite, fd, piece, lo)]
                        done += PIECE
                        if moved is not None:
                            moved[0] = done
                        if stop.is_set():
                            break
                for futures in in_flight:
                    for future in futures:
                        future.result()
        finally:
            os.close(fd)
        return done


def start_writer(kind: str, writer: Writer):
    """Start the phase's writer; returns a function that stops it and gives the bytes it moved."""
    stop = threading.Event()
    if kind != "process":
        moved = [0]
        thread = threading.Thread(target=writer.run, args=(stop, moved, kind == "thread", kind != "thread_dma"),
                                  name="writer-beside-steps")
        thread.start()

        def end_thread() -> int:
            stop.set()
            thread.join()
            return moved[0]
        return end_thread
    read_end, write_end = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: no device, no thread of the parent's; stops when the parent closes its pipe end
        os.close(write_end)
        torch.set_num_threads(1)  # no intra-op pool inherited half-made through the fork
        threading.Thread(target=lambda: (os.read(read_end, 1), stop.set()), daemon=True).start()
        code = 0
        try:
            done = writer.run(stop)
            with open(writer.path + ".moved", "w") as f:
                f.write(str(done))
        except BaseException:
            code = 1
        os._exit(code)
    os.close(read_end)

    def end_process() -> int:
        os.close(write_end)
        _, status = os.waitpid(pid, 0)
        if status != 0:
            raise RuntimeError(f"the writer process ended with status {status}")
        with open(writer.path + ".moved") as f:
            return int(f.read())
    return end_process


def shared_source(nbytes: int) -> torch.Tensor:
    """``nbytes`` of host memory that a forked child sees (MAP_SHARED), filled, as a uint8 tensor."""
    region = mmap.mmap(-1, nbytes, flags=mmap.MAP_SHARED | mmap.MAP_ANONYMOUS)
    source = torch.frombuffer(region, dtype=torch.uint8)
    source.copy_(torch.randint(0, 256, (min(nbytes, 64 << 20),), dtype=torch.uint8).repeat(
        -(-nbytes // (64 << 20)))[:nbytes])
    return source


def summary(rows: List[tuple]) -> List[str]:
    """Each phase's steps against the median of the first phase's (rows: phase index, kind, seconds, bytes, s), with
    what its writer moved."""
    lines = phase_summary([(index, kind, seconds) for index, kind, seconds, _, _ in rows], "steps", digits=3)
    moved = {index: (nbytes, span) for index, _, _, nbytes, span in rows}
    return [line + (f"; the writer moved {moved[i][0] / 1e9:.2f} GB at {moved[i][0] / moved[i][1] / 1e9:.2f} GB/s"
                    if moved[i][0] else "") for i, line in zip(sorted(moved), lines)]


def main(argv: List[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("dir")
    parser.add_argument("--gb", type=float, default=8.0)
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--phases", default="none,thread,process,thread_nocopy,thread_dma,none,process,thread")
    parser.add_argument("--layers", type=int, default=28)
    parser.add_argument("--hidden", type=int, default=3072)
    parser.add_argument("--ffn", type=int, default=8192)
    parser.add_argument("--heads", type=int, default=24)
    parser.add_argument("--seq", type=int, default=2048)
    parser.add_argument("--micro", type=int, default=8)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = parser.parse_args(argv)
    phases = args.phases.split(",")
    unknown = sorted(set(phases) - set(PHASES))
    if unknown:
        print(f"writer_beside_steps.py: --phases: unknown {','.join(unknown)} (known: {', '.join(PHASES)})",
              file=sys.stderr)
        return 2
    device = torch.device(args.device)
    dtype = torch.bfloat16
    os.makedirs(args.dir, exist_ok=True)
    source = shared_source(max(PIECE, int(args.gb * 1e9) // PIECE * PIECE))
    writer = Writer(source, os.path.join(args.dir, f".writer_beside_steps.{os.getpid()}"))
    with device:  # made where they run: 3 B parameters initialised on the host would take longer than the phases
        blocks = [Block(args.hidden, args.ffn, args.heads).to(dtype) for _ in range(args.layers)]
    inputs = torch.randn(1, args.seq, args.hidden, device=device, dtype=dtype)
    params = sum(p.numel() for b in blocks for p in b.parameters())
    print(f"writer_beside_steps: {args.layers} blocks, {params / 1e9:.2f} B params, {args.micro} x {args.seq} tokens "
          f"a step on {device}; the writer streams {source.numel() / 1e9:.2f} GB into {args.dir}", flush=True)
    for _ in range(2):
        step(blocks, inputs, args.micro, device)  # warm-up
    rows = []
    try:
        for index, kind in enumerate(phases):
            end = start_writer(kind, writer) if kind != "none" else None
            began = time.perf_counter()
            steps = [step(blocks, inputs, args.micro, device) for _ in range(args.steps)]
            moved = end() if end is not None else 0
            span = time.perf_counter() - began
            rows += [(index, kind, s, moved, span) for s in steps]
            print(f"phase {index} ({kind}): steps " + ", ".join(f"{s:.3f}" for s in steps) + " s", flush=True)
    finally:
        for path in (writer.path, writer.path + ".moved"):
            if os.path.exists(path):
                os.unlink(path)
    for line in summary(rows):
        print(line)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
