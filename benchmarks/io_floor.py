"""Physical floor of the update phase, measured in the same machine session as the runs.

Plain measurements, independent of the engine under test: O_DIRECT disk read/write bandwidth
(threads over aligned blocks, as any pipelined swapper can get), a buffered tmpfs probe, the CPU's
fused AdamW rate, pinned host<->device copy bandwidth.
"""

from __future__ import annotations

import mmap
import os
import time
from concurrent.futures import ThreadPoolExecutor

import torch

BLOCK = 8 << 20


def _aligned(nbytes: int) -> mmap.mmap:
    return mmap.mmap(-1, nbytes)  # page-aligned anonymous memory: valid for O_DIRECT


def file_bandwidth(directory: str, nbytes: int, threads: int = 8, odirect: bool = True) -> dict:
    """Write ``nbytes`` (fsync) then read them back; GB/s each way. Then half the threads read the file's
    first half while the other half overwrite its second (``mixed_gbps``: both directions' bytes over the
    time), as a pipelined swapper reads ahead and writes behind at once: many disks overlap the two. O_DIRECT
    keeps the page cache out."""
    os.makedirs(directory, exist_ok=True)
    path = os.path.join(directory, f".floor_probe.{os.getpid()}")
    nbytes = max(BLOCK, nbytes // BLOCK * BLOCK)
    flags = os.O_DIRECT if odirect and hasattr(os, "O_DIRECT") else 0
    offsets = range(0, nbytes, BLOCK)
    buffers = [_aligned(BLOCK) for _ in range(threads)]
    for b in buffers:
        b.write(os.urandom(4096) * (BLOCK // 4096))
    try:
        fd = os.open(path, os.O_CREAT | os.O_RDWR | flags, 0o600)
    except OSError:  # tmpfs and some file systems have no O_DIRECT
        flags, odirect = 0, False
        fd = os.open(path, os.O_CREAT | os.O_RDWR, 0o600)
    try:
        os.ftruncate(fd, nbytes)

        def write(i_off):
            i, off = i_off
            os.pwrite(fd, buffers[i % threads], off)

        def read(i_off):
            i, off = i_off
            os.preadv(fd, [buffers[i % threads]], off)

        with ThreadPoolExecutor(threads) as pool:
            start = time.perf_counter()
            list(pool.map(write, enumerate(offsets)))
            os.fsync(fd)
            write_s = time.perf_counter() - start
            if not odirect:  # drop what the write left in the page cache where we can
                os.posix_fadvise(fd, 0, nbytes, os.POSIX_FADV_DONTNEED)
            start = time.perf_counter()
            list(pool.map(read, enumerate(offsets)))
            read_s = time.perf_counter() - start
            # Reads of the first half beside writes of the second, their blocks interleaved in the queue, on
            # buffers of their own (a read must not land in a buffer a write is sending).
            half = len(offsets) // 2
            reads = [(2 * k, off) for k, off in enumerate(offsets[:half])]
            writes = [(2 * k + 1, off) for k, off in enumerate(offsets[half:])]
            jobs = [job for pair in zip(reads, writes) for job in pair] + reads[len(writes):] + writes[len(reads):]
            start = time.perf_counter()
            list(pool.map(lambda job: (read if job[0] % 2 == 0 else write)(job), jobs))
            os.fsync(fd)
            mixed_s = time.perf_counter() - start
    finally:
        os.close(fd)
        os.unlink(path)
    return {"path": directory, "bytes": nbytes, "threads": threads, "odirect": bool(flags),
            "write_gbps": nbytes / write_s / 1e9, "read_gbps": nbytes / read_s / 1e9,
            "mixed_gbps": len(jobs) * BLOCK / mixed_s / 1e9,
            "st_dev": os.stat(directory).st_dev}


def adam_rate(numel: int, repeats: int = 3) -> dict:
    """Elements/s of torch's fused CPU AdamW (what our engine, megatron-core and DeepSpeed's CPU
    Adam all come down to) on one tensor of ``numel`` elements, best of ``repeats`` after a warm-up."""
    p = torch.zeros(numel, requires_grad=True)
    p.grad = torch.full((numel,), 1e-3)
    opt = torch.optim.AdamW([p], lr=1e-4, betas=(0.9, 0.95), weight_decay=0.1, fused=True)
    opt.step()
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        opt.step()
        best = min(best, time.perf_counter() - start)
    del opt, p
    return {"numel": numel, "threads": torch.get_num_threads(), "seconds": best, "params_per_s": numel / best}


def pinned_copy(nbytes: int = 1 << 30) -> dict:
    if not torch.cuda.is_available():
        return {"skipped": "no CUDA device"}
    host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    dev = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    result = {}
    for name, dst, src in (("h2d_gbps", dev, host), ("d2h_gbps", host, dev)):
        dst.copy_(src, non_blocking=True)
        torch.cuda.synchronize()
        best = float("inf")
        for _ in range(3):
            start = time.perf_counter()
            dst.copy_(src, non_blocking=True)
            torch.cuda.synchronize()
            best = min(best, time.perf_counter() - start)
        result[name] = nbytes / best / 1e9
    del host, dev
    torch.cuda.empty_cache()
    return result


def device_seconds(read_bytes: float, write_bytes: float, bw: dict) -> float:
    """The least time one device needs to read and write these bytes at the probed rates: one direction
    after the other, or, where the probe measured both at once (``mixed_gbps``), no less than each
    direction alone and both directions' bytes at the mixed rate, if that is shorter."""
    one_then_other = read_bytes / (bw["read_gbps"] * 1e9) + write_bytes / (bw["write_gbps"] * 1e9)
    if not bw.get("mixed_gbps"):
        return one_then_other
    at_once = max(read_bytes / (bw["read_gbps"] * 1e9), write_bytes / (bw["write_gbps"] * 1e9),
                  (read_bytes + write_bytes) / (bw["mixed_gbps"] * 1e9))
    return min(one_then_other, at_once)


def io_seconds(traffic: dict, bandwidths: dict) -> float:
    """Time the devices need for ``traffic`` {tier: (read_bytes, write_bytes)}: tiers on one device
    (same st_dev) add up, devices run in parallel (``device_seconds`` each)."""
    per_device = {}
    for tier, (rb, wb) in traffic.items():
        bw = bandwidths[tier]
        per_device[bw["st_dev"]] = per_device.get(bw["st_dev"], 0.0) + device_seconds(rb, wb, bw)
    return max(per_device.values(), default=0.0)
