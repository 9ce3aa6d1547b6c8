"""A Python-bound thread beside a checkpoint writer at a fixed byte rate, by the writer's piece size (CPU).

    python benchmarks/experiments/gil_pieces.py [--rate GBPS] [--seconds S] [--repeats N] [--pieces MIB ...] [PATH]

The training thread's forward and backward is mostly Python launching work. Beside it, the offloaded state's paced
writer (``direct_io.DirectRegionWriter`` with a ``pace``) takes the interpreter's lock a few times a piece: the copy
into staging, the CRC, the write. Here the main thread runs small torch ops for ``--seconds`` alone and then beside a
writer held to ``--rate`` GB/s (its ``pace`` sleeps to that rate, so each piece size moves the same bytes) into a
file at PATH (default /var/tmp), ``--repeats`` times each, and prints the main thread's ops/s and its voluntary
context switches (``/proc/self/task/<tid>/status``), then each setting's median. The piece size is set through
``direct_io.PIECE``, and through ``direct_io.PACED_PIECE`` where the tree has it (``paced_pieces.patch``).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import threading
import time

import torch

sys.path.insert(0, os.path.abspath(os.path.join(os.path.dirname(__file__), "..", "..")))
from mlp_offload.tiers import direct_io  # noqa: E402

SPAN = 1 << 30  # the file's bytes, written over and over


def voluntary_switches() -> int:
    with open(f"/proc/self/task/{threading.get_native_id()}/status") as status:
        for line in status:
            if line.startswith("voluntary_ctxt_switches"):
                return int(line.split()[1])
    return 0


def python_bound(seconds: float) -> tuple:
    """(ops/s, voluntary switches) of small torch ops for ``seconds`` on this thread."""
    a, done, before, began = torch.ones(256), 0, voluntary_switches(), time.perf_counter()
    while time.perf_counter() - began < seconds:
        for _ in range(100):
            a = a.add(1.0).mul_(0.5)
        done += 100
    return done / (time.perf_counter() - began), voluntary_switches() - before


class Writer(threading.Thread):
    """A region writer with pieces of ``piece`` bytes, held to ``rate`` bytes/s, until stopped."""

    def __init__(self, path: str, source: torch.Tensor, piece: int, rate: float):
        super().__init__(daemon=True)
        self.path, self.source, self.piece, self.rate = path, source, piece, rate
        self.stop, self.written, self.began = threading.Event(), 0, time.perf_counter()

    def pace(self, nbytes: int) -> None:
        self.written += nbytes
        ahead = self.written / self.rate - (time.perf_counter() - self.began)
        if ahead > 0:
            time.sleep(ahead)

    def run(self) -> None:
        direct_io.PIECE = self.piece
        if hasattr(direct_io, "PACED_PIECE"):
            direct_io.PACED_PIECE = self.piece
        with open(self.path, "wb") as f:
            writer = direct_io.DirectRegionWriter(f.fileno(), self.path, pace=self.pace)
            offset = 0
            try:
                while not self.stop.is_set():
                    writer.put(offset % SPAN, [self.source])
                    offset += self.source.numel()
                writer.finish()
            finally:
                writer.close()


def main(argv) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("path", nargs="?", default="/var/tmp")
    parser.add_argument("--rate", type=float, default=1.0, help="the writer's GB/s")
    parser.add_argument("--seconds", type=float, default=4.0)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--pieces", type=int, nargs="+", default=[16, 64], help="piece sizes in MiB")
    parser.add_argument("--source-mib", type=int, default=256, help="the bytes each put writes, in MiB")
    args = parser.parse_args(argv)
    target = os.path.join(args.path, f"gil_pieces_{os.getpid()}.bin")
    source = torch.randint(0, 255, (args.source_mib << 20,), dtype=torch.uint8)
    settings = [("alone", None)] + [(f"{mib} MiB pieces", mib << 20) for mib in args.pieces]
    seen = {label: [] for label, _ in settings}
    original = direct_io.PIECE, getattr(direct_io, "PACED_PIECE", None)
    try:
        for repeat in range(args.repeats):
            for label, piece in settings:  # interleaved, so a drift of the machine falls on every setting
                writer = None
                if piece is not None:
                    writer = Writer(target, source, piece, args.rate * 1e9)
                    writer.start()
                    time.sleep(0.5)  # past its first pieces
                moved, began = (writer.written if writer else 0), time.perf_counter()
                ops, switches = python_bound(args.seconds)
                gbps = (writer.written - moved) / (time.perf_counter() - began) / 1e9 if writer else 0.0
                if writer is not None:
                    writer.stop.set()
                    writer.join()
                seen[label].append((ops, switches))
                print(f"{repeat} {label}: {ops:.0f} ops/s, {switches} voluntary switches, writer {gbps:.2f} GB/s",
                      flush=True)
    finally:
        direct_io.PIECE = original[0]
        if original[1] is not None:
            direct_io.PACED_PIECE = original[1]
        if os.path.exists(target):
            os.remove(target)
    alone = statistics.median(ops for ops, _ in seen["alone"])
    for label, runs in seen.items():
        ops = statistics.median(o for o, _ in runs)
        print(f"{label}: median {ops:.0f} ops/s ({ops / alone:.2f} of alone), "
              f"{statistics.median(s for _, s in runs):.0f} voluntary switches in {args.seconds:.1f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
