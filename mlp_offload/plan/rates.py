"""Measuring (this module does I/O): each file tier's read/write/mixed bandwidth through the
tier's own I/O path (cached per path and host, ``probe_cache``), and the CPU rates of the Adam
kernel and of gradient conversion, at the subgroup size."""

from __future__ import annotations

import logging
import os
import time

import torch

from . import probe_cache
from ..config import TierBandwidth, probe_piece_bytes
from ..subgroups import Subgroup
from ..gradients import HostGradients, ModelBuffers
from ..kernels.fused_update import AdamHyper
from ..kernels.remainders import HostParamHigh
from ..kernels.update import Fp32Working
from ..step.device_side import DeviceIO, DeviceJob
from ..tiers.align import ALIGN, align_down
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
    CPU caches and overstate the rate (it was 2x off at 4 M elements on the GPU machine).
    """
    params, grads, exp_avg, exp_avg_sq = (torch.empty(numel).fill_(v) for v in (0.5, 1e-3, 1e-4, 1e-6))
    if one_pass is not None:
        return numel / _best_of(lambda i: one_pass((params, exp_avg, exp_avg_sq), grads, None,
                                                   _measuring_hyper(0), i), repeats)
    best = float("inf")
    for i in range(repeats + 1):
        start = time.perf_counter()
        adam_step(params, grads, exp_avg, exp_avg_sq, step=i + 1)
        if i:  # the first call warms up threads and pages
            best = min(best, time.perf_counter() - start)
    return numel / best


def measure_cpu_update_rate(adam_step, codecs, numel: int = 1 << 24, repeats: int = 3, one_pass=None) -> float:
    """Elements per second of the CPU Adam on state stored in ``codecs``: with the widening to fp32
    and the rounding back that narrow state costs (bf16 moments made it 2.5x slower than the fp32
    figure on the GPU machine's CPU); or of ``one_pass`` (``cpu_one_pass.CpuOnePass``), the kernel
    doing all three in one pass, where the update runs that."""
    if all(c.is_fp32 for c in codecs):
        return measure_adam_rate(adam_step, numel, repeats, one_pass)
    stored = [c.empty(numel).fill_(v) for c, v in zip(codecs, (0.5, 1e-4, 1e-6))]
    grads = torch.empty(numel).fill_(1e-3)
    high = torch.empty(numel, dtype=torch.bfloat16).fill_(0.5) if codecs[0].needs_high else None
    if one_pass is not None:
        return numel / _best_of(lambda i: one_pass(stored, grads, high, _measuring_hyper(0), i), repeats)
    working = Fp32Working(codecs, numel)

    def step(i):
        wide = working.widen(stored, high)
        adam_step(wide[0], grads, wide[1], wide[2], step=i)
        working.round_back(stored, wide, high)
    return numel / _best_of(step, repeats)


def measure_device_rates(updater, adam_step, codecs, numel: int, repeats: int = 2):
    """(resident, streamed) elements/s of ``updater`` (a ``DeviceUpdate``): Adam on state in device
    memory, and on host state streamed through it (copies overlapped), in the real stored formats.
    On the CPU twin both are CPU figures."""
    sg = Subgroup(0, 0, numel, tuple(codecs))
    pin = updater.device.type == "cuda"
    host = [c.empty(numel, pin_memory=pin).fill_(v) for c, v in zip(codecs, (0.5, 1e-4, 1e-6))]
    dev = [t.to(updater.device) for t in host]
    segments = [(0, numel, 0, (0, numel))]

    def adam(p, g, m, v, group, span, step=[0]):
        step[0] += 1
        adam_step(p, g, m, v, step=step[0])

    # What a step does around each subgroup's Adam on the device: its grads cast from the model's
    # bf16 grad buffer, its bf16 high halves read from the model's params, its updated params
    # written back there (fills instead of these copies made the resident rate read 153 G/s where
    # 10.24 B steps ran 94, H200, 2026-11-26).
    grads16 = torch.full((numel,), 1e-3, dtype=torch.bfloat16, device=updater.device)
    params16 = torch.full((numel,), 0.5, dtype=torch.bfloat16, device=updater.device)
    remainders = codecs[0].needs_high
    out_dtype = torch.bfloat16 if remainders else codecs[0].storage_dtype
    params_out = torch.empty(numel, dtype=out_dtype, device=updater.device)

    def params_back(start, end, params):
        params_out[start:end].copy_(params)

    # Or, with the one-pass kernel on the model's buffers, those same two tensors read and written in place.
    model = _probe_model(updater, grads16, params16 if remainders else params_out)

    io = DeviceIO(lambda out: out.copy_(grads16[: out.numel()]), adam, params_back,
                  lambda start, end, out: out.copy_(params16[start:end]), hyper=_measuring_hyper, step=1, model=model)

    def run_k(stored, resident, k):
        def once(_):
            for _ in range(k):
                fence = updater.update(DeviceJob(sg, stored, resident, segments), io)
            fence.synchronize()
        return _best_of(once, repeats)

    # Subgroups back to back, as a step issues them, and the steady rate from two run lengths: a
    # run's first copy-in and last copy-out overlap nothing, which three in a row counted a third
    # of (streamed 6.4 G/s at start-up where 20.68 B steps streamed 8.2, H200, 2026-11-26).
    def run(stored, resident):
        short, long = run_k(stored, resident, 1), run_k(stored, resident, 4)
        return 3 * numel / max(long - short, 1e-9) if long > short else 4 * numel / long
    return run(dev, True), run(host, False)


def _probe_model(updater, grads: torch.Tensor, params: torch.Tensor):
    """The model's buffers for a probe of ``updater``: ``grads`` and ``params`` where it uses them in
    place (``on_model_buffers``), else None."""
    if not updater.on_model_buffers:
        return None
    return ModelBuffers(HostGradients(grads), HostParamHigh(params))


def _measuring_hyper(group: int) -> AdamHyper:
    """Hyperparameters for timing the one-pass kernel (the rate does not depend on them)."""
    return AdamHyper(1e-3, 0.9, 0.95, 1e-8, 0.1)


def _best_of(fn, repeats: int) -> float:
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


def measure_shared_rates(updater, cpu_step, adam_step, codecs, numel: int, piece: int = 1 << 21,
                         cpu_one_pass=None):
    """(CPU, streamed) elements/s while both run at once, as a split step runs them: the device
    streams host state through ``updater`` while the CPU runs ``cpu_step(p, g, m, v, step)`` (its
    Adam with the widening; or ``cpu_one_pass``, where the update runs that) piece by piece, and the CPU's grads come down and its params go up
    over PCIe on a side stream, as the Megatron adapter's path moves them. None on a CPU run:
    there the "device" is the same cores, nothing runs beside anything."""
    if updater.device.type != "cuda":
        return None
    sg = Subgroup(0, 0, numel, tuple(codecs))
    host = [c.empty(numel, pin_memory=True).fill_(v) for c, v in zip(codecs, (0.5, 1e-4, 1e-6))]
    segments = [(0, numel, 0, (0, numel))]
    piece = min(piece, numel)
    cpu_state = [c.empty(piece).fill_(v) for c, v in zip(codecs, (0.5, 1e-4, 1e-6))]
    cpu_working = Fp32Working(codecs, piece)
    # What crosses PCIe for a CPU-updated piece: fp32 grads down; with remainders its bf16 params
    # down (the high halves) and up, else the stored master up.
    high = torch.empty(piece, dtype=torch.bfloat16, pin_memory=True).fill_(0.5) if cpu_working.remainders else None
    up_dtype = torch.bfloat16 if cpu_working.remainders else codecs[0].storage_dtype
    grads_host = torch.empty(piece, pin_memory=True)
    params_host = torch.empty(piece, dtype=up_dtype, pin_memory=True)
    grads_dev = torch.full((piece,), 1e-3, device=updater.device)
    params_dev = torch.full((piece,), 0.5, dtype=up_dtype, device=updater.device)
    stream_model = _probe_model(updater, torch.full((numel,), 1e-3, dtype=torch.bfloat16, device=updater.device),
                                torch.full((numel,), 0.5, dtype=up_dtype, device=updater.device))
    side = torch.cuda.Stream(updater.device)
    in_a_row = 8  # long enough that the CPU's pieces (~1 ms each) time it within a few percent

    def adam(p, g, m, v, group, span, step=[0]):
        step[0] += 1
        adam_step(p, g, m, v, step=step[0])

    stream_io = DeviceIO(lambda out: out.fill_(1e-3), adam, None, lambda start, end, out: out.fill_(0.5),
                         hyper=_measuring_hyper, step=1, model=stream_model)
    best = None
    for attempt in range(3):  # the first warms up threads, pages and kernels
        torch.cuda.synchronize(updater.device)
        start = time.perf_counter()
        for _ in range(in_a_row):
            fence = updater.update(DeviceJob(sg, host, False, segments), stream_io)
        cpu_elems, step = 0, 0
        while not fence.query():
            with torch.cuda.stream(side):  # the CPU path's PCIe traffic: its grads down, its params up
                grads_host.copy_(grads_dev, non_blocking=True)
                if high is not None:
                    high.copy_(params_dev, non_blocking=True)
            side.synchronize()
            step += 1
            if cpu_one_pass is not None:
                cpu_one_pass(cpu_state, grads_host, high, _measuring_hyper(0), step)
            else:
                wide = cpu_working.widen(cpu_state, high)
                cpu_step(wide[0], grads_host, wide[1], wide[2], step=step)
                cpu_working.round_back(cpu_state, wide, high)
            with torch.cuda.stream(side):
                params_host.copy_(high if high is not None else cpu_state[0])
                params_dev.copy_(params_host, non_blocking=True)
            cpu_elems += piece
        seconds = max(time.perf_counter() - start, 1e-9)
        if attempt and cpu_elems:
            rates = (cpu_elems / seconds, in_a_row * numel / seconds)
            best = rates if best is None or rates[1] > best[1] else best
    side.synchronize()
    return best
