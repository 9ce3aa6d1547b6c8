"""Whether a disk keeps its rates when a writer fills the quiet spells between its busy ones: the steps' I/O
beside a checkpoint writer, without a GPU or a model.

    python benchmarks/experiments/disk_sustain.py DIR [--read-gb 4.1] [--write-gb 4.8] [--quiet-s 1.5]
        [--cycles 6] [--phases idle,full,idle,half,idle]

Each cycle is a busy spell, then a quiet one, as a step of the 3.0 B determinism run has them (its update reads
and writes its nvme tier, its forward and backward leave the disk to the checkpoint writer):
- busy: ``--read-gb`` read from one file while ``--write-gb`` are written to another, at once, by O_DIRECT
  threads in 16 MiB pieces; its seconds are the cycle's reading;
- quiet, ``--quiet-s`` long: ``idle`` sleeps; ``full`` writes a third file at the disk's pace for all of it;
  ``half`` writes for its first half only.
A phase is ``--cycles`` such cycles. One line per cycle, then each phase's busy spells against the first idle
phase's median: a disk that keeps its rates shows the same busy seconds after ``full`` as before it.
"""

from __future__ import annotations

import argparse
import mmap
import os
import statistics
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Dict, List, Tuple

PIECE = 16 << 20
THREADS = 8
WRITER_WRAP = 8 << 30  # the writer's file is rewritten from its start past this size
QUIET_SHARE = {"idle": 0.0, "full": 1.0, "half": 0.5}  # of each quiet spell, the share the writer writes in


def open_file(path: str, nbytes: int) -> Tuple[int, bool]:
    """``path`` opened for O_DIRECT reads and writes where the file system has it, sized to ``nbytes``."""
    try:
        fd, direct = os.open(path, os.O_CREAT | os.O_RDWR | os.O_DIRECT, 0o600), True
    except (OSError, AttributeError):  # tmpfs, overlay: through the page cache
        fd, direct = os.open(path, os.O_CREAT | os.O_RDWR, 0o600), False
    os.ftruncate(fd, nbytes)
    return fd, direct


def pieces(nbytes: int) -> List[int]:
    return list(range(0, max(PIECE, nbytes // PIECE * PIECE), PIECE))


class Disk:
    def __init__(self, directory: str, read_gb: float, write_gb: float):
        os.makedirs(directory, exist_ok=True)
        self.read_bytes, self.write_bytes = int(read_gb * 1e9) // PIECE * PIECE, int(write_gb * 1e9) // PIECE * PIECE
        self.paths = [os.path.join(directory, f".disk_sustain_{name}.{os.getpid()}")
                      for name in ("read", "write", "writer")]
        self.read_fd, self.direct = open_file(self.paths[0], self.read_bytes)
        self.write_fd, _ = open_file(self.paths[1], self.write_bytes)
        self.writer_fd, _ = open_file(self.paths[2], WRITER_WRAP)
        self.buffers = [mmap.mmap(-1, PIECE) for _ in range(2 * THREADS)]  # page-aligned: fit for O_DIRECT
        for buffer in self.buffers:
            buffer.write(os.urandom(4096) * (PIECE // 4096))
        self.pool = ThreadPoolExecutor(2 * THREADS)
        self.writer_at = 0
        self._fill(self.read_fd, self.read_bytes)  # the busy spells read what is on the disk

    def _fill(self, fd: int, nbytes: int) -> None:
        list(self.pool.map(lambda off: os.pwrite(fd, self.buffers[(off // PIECE) % THREADS], off), pieces(nbytes)))
        os.fsync(fd)

    def busy_spell(self) -> float:
        """Seconds to read the read file and write the write file at once, half of the threads each."""
        started = time.perf_counter()
        reads = [self.pool.submit(os.preadv, self.read_fd, [self.buffers[THREADS + i % THREADS]], off)
                 for i, off in enumerate(pieces(self.read_bytes))]
        writes = [self.pool.submit(os.pwrite, self.write_fd, self.buffers[i % THREADS], off)
                  for i, off in enumerate(pieces(self.write_bytes))]
        for future in reads + writes:
            future.result()
        return time.perf_counter() - started

    def quiet_spell(self, seconds: float, share: float) -> int:
        """Sleep ``seconds``, the writer writing for ``share`` of them from its start; bytes it wrote."""
        started = time.perf_counter()
        until = started + seconds * share
        written = [0]
        lock = threading.Lock()

        def write(slot: int) -> None:
            while time.perf_counter() < until:
                with lock:
                    off = self.writer_at
                    self.writer_at = (off + PIECE) % WRITER_WRAP
                os.pwrite(self.writer_fd, self.buffers[slot], off)
                with lock:
                    written[0] += PIECE

        if share > 0:
            for future in [self.pool.submit(write, slot) for slot in range(THREADS)]:
                future.result()
        time.sleep(max(0.0, started + seconds - time.perf_counter()))
        return written[0]

    def close(self) -> None:
        self.pool.shutdown()
        for fd in (self.read_fd, self.write_fd, self.writer_fd):
            os.close(fd)
        for path in self.paths:
            os.unlink(path)


def block_device_facts(directory: str) -> str:
    """The scheduler, write cache and rotational flag of the disk under ``directory`` (sysfs), where found."""
    dev = os.stat(directory).st_dev
    base = f"/sys/dev/block/{os.major(dev)}:{os.minor(dev)}"
    if os.path.exists(f"{base}/partition"):
        base = f"{base}/.."
    facts = []
    for name in ("scheduler", "write_cache", "rotational"):
        try:
            with open(f"{base}/queue/{name}") as f:
                facts.append(f"{name} {f.read().strip()}")
        except OSError:
            pass
    return ", ".join(facts) or "no sysfs facts"


def phase_summary(rows: List[Tuple[int, str, float]], what: str, digits: int = 2) -> List[str]:
    """One line per phase (rows: the phase's index, its name, one reading's seconds): its ``what`` against the first
    phase's median."""
    base = statistics.median(s for index, _, s in rows if index == 0)
    phases: Dict[Tuple[int, str], List[float]] = {}
    for index, name, seconds in rows:
        phases.setdefault((index, name), []).append(seconds)
    lines = []
    for (index, name), seconds in phases.items():  # in the order the phases ran
        middle, most = statistics.median(seconds), max(seconds)
        lines.append(f"phase {index} ({name}): {what} {min(seconds):.{digits}f}-{most:.{digits}f} s, median "
                     f"{middle:.{digits}f} s: {middle / base:.{digits}f}x, worst {most / base:.{digits}f}x the first "
                     f"phase's median ({base:.{digits}f} s)")
    return lines


def summary(rows: List[Tuple[str, int, float, int]]) -> List[str]:
    """Each phase's busy spells (rows: phase, its index, seconds, bytes written after) against the first phase's."""
    return phase_summary([(index, phase, seconds) for phase, index, seconds, _ in rows], "busy spells")


def main(argv: List[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("dir")
    parser.add_argument("--read-gb", type=float, default=4.1)
    parser.add_argument("--write-gb", type=float, default=4.8)
    parser.add_argument("--quiet-s", type=float, default=1.5)
    parser.add_argument("--cycles", type=int, default=6)
    parser.add_argument("--phases", default="idle,full,idle,half,idle")
    args = parser.parse_args(argv)
    phases = args.phases.split(",")
    unknown = [p for p in phases if p not in QUIET_SHARE]
    if unknown:
        print(f"disk_sustain.py: --phases: unknown {','.join(unknown)} (known: {', '.join(QUIET_SHARE)})",
              file=sys.stderr)
        return 2
    disk = Disk(args.dir, args.read_gb, args.write_gb)
    print(f"disk_sustain: {args.dir} ({'O_DIRECT' if disk.direct else 'page cache'}; {block_device_facts(args.dir)});"
          f" busy spells read {disk.read_bytes / 1e9:.2f} GB and write {disk.write_bytes / 1e9:.2f} GB at once; "
          f"quiet spells {args.quiet_s} s", flush=True)
    rows = []
    try:
        for index, phase in enumerate(phases):
            for cycle in range(args.cycles):
                seconds = disk.busy_spell()
                written = disk.quiet_spell(args.quiet_s, QUIET_SHARE[phase])
                rows.append((phase, index, seconds, written))
                moved = disk.read_bytes + disk.write_bytes
                print(f"phase {index} ({phase}) cycle {cycle}: busy {seconds:.2f} s ({moved / seconds / 1e9:.2f} GB/s);"
                      f" then the writer wrote {written / 1e9:.2f} GB in {args.quiet_s * QUIET_SHARE[phase]:.2f} s",
                      flush=True)
    finally:
        disk.close()
    for line in summary(rows):
        print(line)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
