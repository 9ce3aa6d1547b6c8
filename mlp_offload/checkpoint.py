"""Streaming save/load of one engine's offloaded state to a single checkpoint file.

Layout: the fp32 (param, exp_avg, exp_avg_sq) of each subgroup, one after the other, then a JSON
footer (element ranges, byte offsets, CRC32 of every tensor, the step count, caller metadata), then
a 16-byte trailer (magic + footer length). The file is written as ``<path>.tmp``, fsynced and
renamed, so a crash leaves either the old file or no file, never a torn one.

Loading is by element range, independent of how the saving engine was split into subgroups or
where its state lived: a run may resume with other tier paths, host budget or subgroup size.
"""

from __future__ import annotations

import json
import os
import struct
import zlib
from typing import Dict, Optional, Tuple

import torch

from .engine import OffloadedAdamW
from .faults import fault_point
from .tiers.files import fsync_path

MAGIC = b"MLPOFFv1"
TRAILER = struct.Struct("<8sQ")
NAMES = ("param", "exp_avg", "exp_avg_sq")


class CheckpointDataError(RuntimeError):
    """A checkpoint file is missing, truncated, corrupt or does not fit this engine."""


def save_engine_state(engine: OffloadedAdamW, path: str, metadata: Optional[dict] = None) -> int:
    """Stream the engine's state into ``path``; returns bytes written."""
    tmp = path + ".tmp"
    entries = []
    with open(tmp, "wb") as f:
        for sg, *tensors in engine.iter_state():
            entry = {"start": sg.start, "end": sg.end, "offset": f.tell(), "crc": []}
            for t in tensors:
                view = memoryview(t.numpy()).cast("B")
                f.write(view)
                entry["crc"].append(zlib.crc32(view))
            entries.append(entry)
            fault_point("save-offload")
        footer = json.dumps({
            "numel": engine.numel, "steps_done": engine.steps_done, "subgroups": entries,
            "metadata": metadata or {},
        }).encode()
        f.write(footer)
        f.write(TRAILER.pack(MAGIC, len(footer)))
        f.flush()
        os.fsync(f.fileno())
        size = f.tell()
    os.replace(tmp, path)
    fsync_path(os.path.dirname(os.path.abspath(path)))
    return size


def read_footer(path: str) -> dict:
    try:
        size = os.path.getsize(path)
        with open(path, "rb") as f:
            if size < TRAILER.size:
                raise CheckpointDataError(f"{path}: truncated ({size} bytes, no trailer)")
            f.seek(size - TRAILER.size)
            magic, footer_len = TRAILER.unpack(f.read(TRAILER.size))
            if magic != MAGIC or footer_len > size - TRAILER.size:
                raise CheckpointDataError(f"{path}: not a complete offload checkpoint (bad trailer; truncated?)")
            f.seek(size - TRAILER.size - footer_len)
            footer = json.loads(f.read(footer_len))
    except FileNotFoundError:
        raise CheckpointDataError(f"{path}: the offloaded optimizer state is missing") from None
    except (ValueError, UnicodeDecodeError) as err:
        raise CheckpointDataError(f"{path}: unreadable footer: {err}") from err
    data_end = size - TRAILER.size - footer_len
    for e in footer["subgroups"]:
        if e["offset"] + 3 * 4 * (e["end"] - e["start"]) > data_end:
            raise CheckpointDataError(f"{path}: truncated: subgroup data at byte {e['offset']} runs past the data")
    return footer


def load_engine_state(engine: OffloadedAdamW, path: str) -> dict:
    """Fill the engine from ``path`` (CRC-checked before use); returns the saved metadata."""
    footer = read_footer(path)
    if footer["numel"] != engine.numel:
        raise CheckpointDataError(
            f"{path}: holds {footer['numel']} elements but this rank's shard has {engine.numel} "
            f"(different model or parallel layout)")
    reader = RangeReader(path, footer["subgroups"])
    try:
        def fill(sg, param, exp_avg, exp_avg_sq):
            for k, out in enumerate((param, exp_avg, exp_avg_sq)):
                reader.read(k, sg.start, sg.end, out)

        engine.load_state(fill, steps_done=footer["steps_done"])
    finally:
        reader.close()
    return footer["metadata"]


class RangeReader:
    """Reads element ranges of one state tensor across the stored subgroups of one file. Each
    stored tensor is CRC-checked as it is read; the two most recent stored subgroups stay cached,
    so ascending requests (a plain resume) read each once, other orders (resharding) may re-read."""

    def __init__(self, path: str, entries):
        self.path = path
        self.entries = sorted(entries, key=lambda e: e["start"])
        self.f = open(path, "rb")
        self._cached: Dict[Tuple[int, int], torch.Tensor] = {}

    def read(self, k: int, start: int, end: int, out: torch.Tensor) -> None:
        pos = start
        for e in self.entries:
            lo, hi = max(pos, e["start"]), min(end, e["end"])
            if lo >= hi:
                continue
            data = self._stored(e, k)
            out[lo - start: hi - start].copy_(data[lo - e["start"]: hi - e["start"]])
            pos = hi
        if pos != end:
            raise CheckpointDataError(f"{self.path}: elements {pos}..{end} are not in the checkpoint")

    def _stored(self, e, k: int) -> torch.Tensor:
        key = (e["start"], k)
        if key not in self._cached:
            # Keep the two most recent stored subgroups: a range may straddle two of them.
            starts = list(dict.fromkeys(kk[0] for kk in self._cached))
            if e["start"] not in starts and len(starts) >= 2:
                self._cached = {kk: v for kk, v in self._cached.items() if kk[0] != starts[0]}
            n = e["end"] - e["start"]
            buf = bytearray(4 * n)
            self.f.seek(e["offset"] + k * 4 * n)
            if self.f.readinto(buf) != len(buf):
                raise CheckpointDataError(f"{self.path}: truncated in {NAMES[k]} of elements {e['start']}..{e['end']}")
            if zlib.crc32(buf) != e["crc"][k]:
                raise CheckpointDataError(
                    f"{self.path}: checksum mismatch in {NAMES[k]} of elements {e['start']}..{e['end']}; "
                    f"the checkpoint is corrupt and was not used")
            self._cached[key] = torch.frombuffer(buf, dtype=torch.float32)
        return self._cached[key]

    def close(self) -> None:
        self.f.close()
