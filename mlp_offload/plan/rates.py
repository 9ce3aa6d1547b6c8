"""Measuring (this module does I/O): each file tier's read/write/mixed bandwidth through the
tier's own I/O path (cached per path and host, ``probe_cache``), and the CPU rates of the Adam
kernel and of gradient conversion, at the subgroup size. The device update's rates are measured
beside it (``step.path_rates``)."""

from __future__ import annotations

import logging
import os
import time

import torch

from . import probe_cache
from ..config import TierBandwidth, probe_piece_bytes
from ..kernels.fused_update import AdamHyper
from ..kernels.update import Fp32Working
from ..config.align import ALIGN, align_down
from ..tiers.files import FileTier, fsync_path

log = logging.getLogger("mlp_offload")


def probe_tier(tier: FileTier, host_buffer: torch.Tensor, concurrency: int = 2,
               ranks_sharing: int = 1) -> TierBandwidth:
    """Write then read ``host_buffer`` through ``tier``, then both at once; cached in the tier directory.

    The buffer moves as ``concurrency`` files at once, as the engine keeps that many subgroup
    operations in flight, so the probe sees the bandwidth the pipeline can really get. Where
    ``ranks_sharing`` ranks of the node use the path, the mixed phase runs once more with that
    many times the streams and threads, as all of them would issue without turn-taking. A file
    lock serializes probes of one path, so ranks starting together neither disturb each other's
    measurement nor probe the same path more than once. A buffer too small to give each of the
    ``concurrency`` files two pages is an ``OffloadConfigError`` (see ``probe_piece_bytes``).
    """
    cache_path = probe_cache.path_for(tier.root)
    signature = {
        "bytes": host_buffer.numel(),
        "block_bytes": tier.block_bytes,
        "odirect": tier.odirect,
        "threads": tier.io_threads,
        "concurrency": concurrency,
        "ranks_sharing": ranks_sharing,
        # Bumped when what a phase measures changes, so older caches are measured again.
        "phases": "write,read,mixed" + (",shared" if ranks_sharing > 1 else "") + ",odirect-unflushed,whole-file-reads",
    }
    with probe_cache.node_lock(tier.root, tier.lock_root):  # node-local: no lock on a shared file system
        cached = probe_cache.read(cache_path, signature)
        if cached is not None:
            return cached
        piece = probe_piece_bytes(host_buffer.numel(), concurrency)
        parts = [(f".probe.{os.getpid()}.{k}", [(0, host_buffer[k * piece:(k + 1) * piece])])
                 for k in range(concurrency)]
        start = time.perf_counter()
        for f in [tier.submit_write(key, ext) for key, ext in parts]:
            f.result()
        _settle(tier, [key for key, _ in parts])
        write_s = time.perf_counter() - start
        start = time.perf_counter()
        for f in [tier.submit_read(key, ext) for key, ext in parts]:
            f.result()
        read_s = time.perf_counter() - start
        mixed_bps = _mixed_rate(tier, parts, piece, 1)
        shared_bps = None
        if ranks_sharing > 1:
            with tier.widened(ranks_sharing):
                shared_bps = _mixed_rate(tier, parts, piece, ranks_sharing)
        for key, _ in parts:
            tier.forget(key)
        nbytes = piece * concurrency
        result = TierBandwidth(read_bps=nbytes / read_s, write_bps=nbytes / write_s, mixed_bps=mixed_bps,
                               shared_mixed_bps=shared_bps)
        probe_cache.write(cache_path, signature, result, tier.name)
        return result


def _settle(tier: FileTier, keys) -> None:
    """Buffered writes sit in the page cache: fsync them, or the probe times memory copies.
    O_DIRECT writes are on the device when they return, as the engine's swap writes are (which it
    never fsyncs), so timing a flush there would charge the probe a cost the update never pays."""
    if not tier.odirect:
        for key in keys:
            fsync_path(tier.path_of(key))


def _mixed_rate(tier: FileTier, parts, piece: int, streams_each: int) -> float:
    """Bytes/s while files are read back and new ones written at once, as the update's read-ahead
    and write-behind do (many devices overlap the two). Each probe file's memory serves
    ``streams_each`` writes from its first half and as many reads into its second. Each read is
    of a whole file, written for it beforehand and not timed: a read of part of a file would end
    inside one of the tier's checksum blocks, and that block's checksum could not match."""
    half = align_down(piece // 2)
    streams_each = max(1, min(streams_each, half // ALIGN))  # a tiny probe: fewer, page-sized streams
    sub = align_down(half // streams_each)
    writes, sources = [], []
    for key, ext in parts:
        region = ext[0][1]
        for j in range(streams_each):
            writes.append((f"{key}.mixed{j}", [(0, region[j * sub:(j + 1) * sub])]))
            sources.append((f"{key}.source{j}", [(0, region[half + j * sub:half + (j + 1) * sub])]))
    for f in [tier.submit_write(key, ext) for key, ext in sources]:
        f.result()
    _settle(tier, [key for key, _ in sources])  # their flush must not land in the timed phase
    start = time.perf_counter()
    futures = [tier.submit_write(key, ext) for key, ext in writes]
    futures += [tier.submit_read(key, ext) for key, ext in sources]
    for f in futures:
        f.result()
    _settle(tier, [key for key, _ in writes])
    seconds = time.perf_counter() - start
    for key, _ in writes + sources:
        tier.forget(key)
    return 2 * len(writes) * sub / seconds


def measure_adam_rate(adam_step, numel: int = 1 << 24, repeats: int = 3, one_pass=None) -> float:
    """Elements per second of the engine's Adam kernel on this CPU (best of ``repeats``); of
    ``one_pass`` (``cpu_one_pass.CpuOnePass``) instead where that replaces it.

    Measured at the subgroup size (capped), as the update runs it: small tensors would sit in the
    CPU caches and overstate the rate.
    """
    params, grads, exp_avg, exp_avg_sq = (torch.empty(numel).fill_(v) for v in (0.5, 1e-3, 1e-4, 1e-6))
    if one_pass is not None:
        return numel / best_of(lambda i: one_pass((params, exp_avg, exp_avg_sq), grads, None,
                                                   measuring_hyper(0), i), repeats)
    best = float("inf")
    for i in range(repeats + 1):
        start = time.perf_counter()
        adam_step(params, grads, exp_avg, exp_avg_sq, step=i + 1)
        if i:  # the first call warms up threads and pages
            best = min(best, time.perf_counter() - start)
    return numel / best


def measure_cpu_update_rate(adam_step, codecs, numel: int = 1 << 24, repeats: int = 3, one_pass=None) -> float:
    """Elements per second of the CPU Adam on state stored in ``codecs``: with the widening to fp32
    and the rounding back that narrow state costs (bf16 moments made it much slower than fp32 state);
    or of ``one_pass`` (``cpu_one_pass.CpuOnePass``), the kernel
    doing all three in one pass, where the update runs that."""
    if all(c.is_fp32 for c in codecs):
        return measure_adam_rate(adam_step, numel, repeats, one_pass)
    stored = [c.empty(numel).fill_(v) for c, v in zip(codecs, (0.5, 1e-4, 1e-6))]
    grads = torch.empty(numel).fill_(1e-3)
    high = torch.empty(numel, dtype=torch.bfloat16).fill_(0.5) if codecs[0].needs_high else None
    if one_pass is not None:
        return numel / best_of(lambda i: one_pass(stored, grads, high, measuring_hyper(0), i), repeats)
    working = Fp32Working(codecs, numel)

    def step(i):
        wide = working.widen(stored, high)
        adam_step(wide[0], grads, wide[1], wide[2], step=i)
        working.round_back(stored, wide, high)
    return numel / best_of(step, repeats)


def measuring_hyper(group: int) -> AdamHyper:
    """Hyperparameters for timing the one-pass kernel (the rate does not depend on them)."""
    return AdamHyper(1e-3, 0.9, 0.95, 1e-8, 0.1)


def best_of(fn, repeats: int) -> float:
    """The fastest seconds of ``fn(i)`` over ``repeats`` calls after a first that warms up."""
    best = float("inf")
    for i in range(repeats + 1):
        start = time.perf_counter()
        fn(i + 1)
        if i:  # the first call warms up threads, pages and kernels
            best = min(best, time.perf_counter() - start)
    return max(best, 1e-9)


def measure_convert_rate(numel: int) -> float:
    """bf16 -> fp32 elements per second at the subgroup size (best of 3)."""
    src = torch.empty(numel, dtype=torch.bfloat16).fill_(0.5)
    dst = torch.empty(numel)
    dst.copy_(src)
    best = float("inf")
    for _ in range(3):
        start = time.perf_counter()
        dst.copy_(src)
        best = min(best, time.perf_counter() - start)
    return numel / max(best, 1e-9)
