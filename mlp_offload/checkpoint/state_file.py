"""One engine's offloaded state in a single checkpoint file: its format, and loading it (writing it:
``checkpoint.write``).

Layout: the (param, exp_avg, exp_avg_sq) of each subgroup in their stored formats, one after the
other, then a JSON footer (element ranges, byte offsets, CRC32 of every tensor, the formats' tags
(``state_formats``: a codec's ``describe()``, e.g. fp32, bf16, rem16), the step
count, caller metadata), then a 24-byte trailer (magic, footer length, CRC32 of the footer). The file is written as
``<path>.tmp``, fsynced and renamed, so a crash leaves either the old file or no file, never a
torn one. Nothing read from the file is used unchecked: the footer's CRC and structure are
verified before any offset in it is followed, and every tensor's CRC before its data is used. A
reader opens a file once (``StateFile``): its footer, then its data through the same handle.

A master stored as remainders (``remainders``) is saved so (tagged ``rem16`` in the footer's
dtypes): the model checkpoint of the same step holds its high halves, the bf16 params.

Loading is by element range, independent of how the saving engine was split into subgroups or
where its state lived: a run may resume with other tier paths, host budget or subgroup size, or
other state dtypes (each tensor is widened or rounded to the engine's as it is copied in).
"""

from __future__ import annotations

import json
import os
import struct
import zlib
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Dict, List, Optional, Set, Tuple

import torch

from ..tiers.direct_io import DirectReads, pread_into
from ..engine import OffloadedAdamW
from ..state_formats import FP32_STATE, REMAINDERS16, codec_for_tag, codecs_for, state_bytes

MAGIC = b"MLPOFFv2"
TRAILER = struct.Struct("<8sQI")  # magic, footer length, CRC32 of the footer
NAMES = ("param", "exp_avg", "exp_avg_sq")


class CheckpointDataError(RuntimeError):
    """A checkpoint file is missing, truncated, corrupt or does not fit this engine."""


class CheckpointSaveError(RuntimeError):
    """A checkpoint file could not be written (e.g. the file system is full); nothing partial is left."""


def state_file_bytes(numel: int, codecs) -> int:
    """Bytes of the tensors a state file holds (the footer, a few KB, comes on top)."""
    return state_bytes(codecs, numel)


def stored_codecs(footer: dict) -> Tuple:
    """The stored formats (``state_formats``) of a file's (param, exp_avg, exp_avg_sq), from its footer's tags."""
    return codecs_for(footer["dtypes"])


class StateFile:
    """One state file, opened once: ``footer`` (checked), then its data read through the same
    handle (``ranges``). Closing it closes every reader made from it."""

    def __init__(self, path: str):
        self.path = path
        self._readers: List["RangeReader"] = []
        try:
            self.file = open(path, "rb")
        except FileNotFoundError:
            raise CheckpointDataError(f"{path}: the offloaded optimizer state is missing") from None
        try:
            size = os.fstat(self.file.fileno()).st_size
            raw = footer_bytes(path, self.file, size)
            try:
                footer = json.loads(raw)
            except (ValueError, UnicodeDecodeError) as err:
                raise CheckpointDataError(f"{path}: unreadable footer: {err}") from err
            _check_footer(path, footer, data_end=size - TRAILER.size - len(raw))
        except BaseException:
            self.file.close()
            raise
        self.footer: dict = footer

    @property
    def metadata(self) -> dict:
        return self.footer.get("metadata", {})

    def ranges(self, cache_bytes: Optional[int] = None) -> "RangeReader":
        reader = RangeReader(self.path, self.footer["subgroups"], stored_codecs(self.footer), cache_bytes, self.file)
        self._readers.append(reader)
        return reader

    def close(self) -> None:
        for reader in self._readers:
            reader.close()
        self._readers = []
        self.file.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def read_footer(path: str) -> dict:
    """The file's footer, after checking its checksum and that its ranges and offsets are sound."""
    with StateFile(path) as saved:
        return saved.footer


def footer_bytes(path: str, f, size: int) -> bytes:
    """The footer's bytes, its checksum verified (every footer a load uses is parsed here, once)."""
    if size >= TRAILER.size:
        f.seek(size - TRAILER.size)
        magic, footer_len, footer_crc = TRAILER.unpack(f.read(TRAILER.size))
        if magic == MAGIC and footer_len <= size - TRAILER.size:
            f.seek(size - TRAILER.size - footer_len)
            raw = f.read(footer_len)
            if zlib.crc32(raw) != footer_crc:
                raise CheckpointDataError(
                    f"{path}: checksum mismatch in the footer (its ranges and offsets); the file is corrupt "
                    f"or was edited, and was not used")
            return raw
    raise CheckpointDataError(f"{path}: not a complete offload checkpoint (bad trailer; truncated?)")


def _check_footer(path: str, footer, data_end: int) -> None:
    """The stored subgroups must tile [0, numel) in order, back to back from byte 0 up to the footer,
    each with three CRCs: a footer that passes its checksum yet says otherwise is not followed."""
    def bad(why: str) -> CheckpointDataError:
        return CheckpointDataError(f"{path}: the footer is inconsistent ({why}); the file was not used")

    if not isinstance(footer, dict) or not all(k in footer for k in ("numel", "steps_done", "subgroups")):
        raise bad("missing numel, steps_done or subgroups")
    numel, steps = footer["numel"], footer["steps_done"]
    if not _is_count(numel) or not _is_count(steps):
        raise bad(f"numel {numel!r}, steps_done {steps!r}")
    dtypes = footer.get("dtypes")
    if not (isinstance(dtypes, list) and len(dtypes) == len(NAMES)
            and all(codec_for_tag(d) is not None for d in dtypes)):
        raise bad(f"state dtypes {str(dtypes)[:80]}")
    codecs = codecs_for(dtypes)
    expected_start, expected_offset = 0, 0
    for e in footer["subgroups"]:
        if not (isinstance(e, dict) and all(_is_count(e.get(k)) for k in ("start", "end", "offset"))
                and isinstance(e.get("crc"), list) and len(e["crc"]) == len(NAMES)
                and all(_is_count(c) for c in e["crc"])):
            raise bad(f"malformed subgroup entry {str(e)[:80]}")
        if e["start"] != expected_start or e["end"] <= e["start"] or e["offset"] != expected_offset:
            raise bad(f"subgroup {e['start']}..{e['end']} at byte {e['offset']}, expected to start at element "
                      f"{expected_start} and byte {expected_offset}")
        expected_start = e["end"]
        expected_offset += state_file_bytes(e["end"] - e["start"], codecs)
    if expected_start != numel:
        raise bad(f"subgroups cover {expected_start} of {numel} elements")
    if expected_offset != data_end:
        raise bad(f"the tensors end at byte {expected_offset} but the footer starts at byte {data_end}; truncated?")
    if not isinstance(footer.get("metadata", {}), dict):
        raise bad("metadata is not a mapping")


def _is_count(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def load_engine_state(engine: OffloadedAdamW, path: str) -> dict:
    """Fill the engine from ``path`` (CRC-checked before use); returns the saved metadata."""
    with StateFile(path) as saved:
        fill_engine(engine, saved)
        return saved.metadata


def fill_engine(engine: OffloadedAdamW, saved: StateFile) -> None:
    """Fill the engine with the whole of an opened state file (the same shard, saved at this layout)."""
    footer, path = saved.footer, saved.path
    if footer["numel"] != engine.numel:
        raise CheckpointDataError(
            f"{path}: holds {footer['numel']} elements but this rank's shard has {engine.numel} "
            f"(different model or parallel layout)")
    # A master saved as remainders completes the model's params loaded beside it: kept so where the
    # engine stores it so too, else merged with them. An fp32 one (engine with remainders) is split
    # by the engine, which sets the model's params from it.
    master_codec = stored_codecs(footer)[0]
    saved_remainders = master_codec.needs_high
    merging = saved_remainders and not engine.config.param_remainders
    if merging and engine.param_high is None:
        raise CheckpointDataError(f"{path}: the master params are stored as 16-bit remainders of the model's "
                                  f"bf16 params, and this engine was given no param_high to merge them with")
    reader = saved.ranges()

    def fill(sg, param, exp_avg, exp_avg_sq):
        if merging:
            rem = master_codec.empty(sg.numel)
            high = torch.empty(sg.numel, dtype=torch.bfloat16)
            reader.read(0, sg.start, sg.end, rem)
            engine.param_high.fill(sg.start, sg.end, high)
            param.copy_(master_codec.unpack(rem, high=high))
        else:
            reader.read(0, sg.start, sg.end, param)
        for k, out in ((1, exp_avg), (2, exp_avg_sq)):
            reader.read(k, sg.start, sg.end, out)

    engine.load_state(fill, steps_done=footer["steps_done"], stored=saved_remainders)


class RangeReader:
    """Reads element ranges of one state tensor across the stored subgroups of one file, widened or
    rounded to the dtype of ``out`` as they are copied. Each stored tensor is CRC-checked before any
    of its data is used; the two most recent stored subgroups stay cached, so ascending requests (a
    plain resume) read each once, other orders (resharding) may re-read. With ``cache_bytes`` a
    stored tensor larger than a sixth of it (two subgroups of three tensors) is not cached: its CRC is
    checked once by streaming it through a bounded buffer, then only the ranges asked for are read.

    While a stored tensor is checked and copied out, the next one in the file is read and checked on a
    thread of its own (where the requests follow the file, as a resume's do): a load then runs at the
    disk's pace rather than at read + CRC + copy one after the other."""

    def __init__(self, path: str, entries, codecs=None, cache_bytes: Optional[int] = None, file=None):
        self.path = path
        self.entries = sorted(entries, key=lambda e: e["start"])
        self.codecs = codecs_for(FP32_STATE) if codecs is None else tuple(codecs)  # how each tensor is stored
        self._owns_file = file is None  # else a StateFile's handle, closed with it
        self.f = open(path, "rb") if file is None else file
        self.cache_bytes = cache_bytes
        self._cached: Dict[Tuple[int, int], torch.Tensor] = {}
        self._verified: Set[Tuple[int, int]] = set()
        self._direct = DirectReads(path)
        by_offset = [(e, k) for e in sorted(self.entries, key=lambda e: e["offset"]) for k in range(3)]
        self._successor = {(e["start"], k): nxt for (e, k), nxt in zip(by_offset, by_offset[1:])}
        self._last: Optional[Tuple[int, int]] = None
        self._ahead: Optional[Tuple[Tuple[int, int], Future]] = None
        self._ahead_thread: Optional[ThreadPoolExecutor] = None
        self.read_ahead_used = 0  # stored tensors that came from the read ahead

    @property
    def cached_elements(self) -> List[int]:
        """Elements of each stored tensor the reader keeps for later reads (``cache_bytes`` bounds them)."""
        return [t.numel() for t in self._cached.values()]

    def read(self, k: int, start: int, end: int, out: torch.Tensor) -> None:
        if self.codecs[k].needs_high != (out.dtype == REMAINDERS16.storage_dtype):  # a remainder is no number
            raise CheckpointDataError(
                f"{self.path}: {NAMES[k]} is stored as 16-bit remainders of the model's bf16 params and cannot "
                f"be read as {out.dtype} (merging it needs the model's params of the same elements)")
        pos = start
        for e in self.entries:
            lo, hi = max(pos, e["start"]), min(end, e["end"])
            if lo >= hi:
                continue
            target = out[lo - start: hi - start]
            if self._cacheable(e, k):
                target.copy_(self._stored(e, k)[lo - e["start"]: hi - e["start"]])
            else:
                self._verify(e, k)
                target.copy_(torch.frombuffer(self._bytes(e, k, lo, hi), dtype=self.codecs[k].storage_dtype))
            pos = hi
        if pos != end:
            raise CheckpointDataError(f"{self.path}: elements {pos}..{end} are not in the checkpoint")

    def _cacheable(self, e, k: int) -> bool:
        nbytes = self.codecs[k].stored_bytes(e["end"] - e["start"])
        return self.cache_bytes is None or 6 * nbytes <= self.cache_bytes

    def _stored(self, e, k: int) -> torch.Tensor:
        key = (e["start"], k)
        if key not in self._cached:
            # Keep the two most recent stored subgroups: a range may straddle two of them.
            starts = list(dict.fromkeys(kk[0] for kk in self._cached))
            if e["start"] not in starts and len(starts) >= 2:
                self._cached = {kk: v for kk, v in self._cached.items() if kk[0] != starts[0]}
            buf, crc = self._fetch(e, k)
            self._check(crc, e, k)
            self._cached[key] = torch.frombuffer(buf, dtype=self.codecs[k].storage_dtype)
            if self._last is None or self._follows(self._last, e, k):
                self._read_ahead(key)
            self._last = key
        return self._cached[key]

    def _follows(self, last: Tuple[int, int], e, k: int) -> bool:
        nxt = self._successor.get(last)
        return nxt is not None and nxt[0] is e and nxt[1] == k

    def _fetch(self, e, k: int):
        """Stored tensor ``k`` of entry ``e`` and its CRC32: from the read ahead where it is that one."""
        ahead, self._ahead = self._ahead, None
        if ahead is not None:
            got = ahead[1].result()  # waited for either way: no read outlives its turn
            if ahead[0] == (e["start"], k):
                self.read_ahead_used += 1
                return got
        return self._read_and_crc(e, k)

    def _read_and_crc(self, e, k: int):
        buf = self._bytes(e, k, e["start"], e["end"])
        return buf, zlib.crc32(buf)  # zlib lets go of the GIL for a buffer this size

    def _read_ahead(self, key: Tuple[int, int]) -> None:
        nxt = self._successor.get(key)
        if nxt is None or (nxt[0]["start"], nxt[1]) in self._cached:
            return
        e, k = nxt
        nbytes = self.codecs[k].stored_bytes(e["end"] - e["start"])
        if self.cache_bytes is not None and 7 * nbytes > self.cache_bytes:  # the bound holds the read ahead too
            return
        if self._ahead_thread is None:
            self._ahead_thread = ThreadPoolExecutor(1, thread_name_prefix="ckpt-read-ahead")
        self._ahead = ((e["start"], k), self._ahead_thread.submit(self._read_and_crc, e, k))

    def _verify(self, e, k: int) -> None:
        if (e["start"], k) in self._verified:
            return
        crc, step = 0, max(1, (self.cache_bytes // 6) // self.codecs[k].bytes_per_element)
        for lo in range(e["start"], e["end"], step):
            crc = zlib.crc32(self._bytes(e, k, lo, min(e["end"], lo + step)), crc)
        self._check(crc, e, k)
        self._verified.add((e["start"], k))

    def _bytes(self, e, k: int, lo: int, hi: int) -> bytearray:
        """Elements [lo, hi) of stored tensor ``k`` of subgroup entry ``e``, as stored."""
        # (element ranges of element-wise formats; a blockwise one's ranges would round to its blocks)
        n, itemsize = e["end"] - e["start"], self.codecs[k].bytes_per_element
        offset = e["offset"] + state_bytes(self.codecs[:k], n) + itemsize * (lo - e["start"])
        nbytes = itemsize * (hi - lo)
        buf = self._direct.read(offset, nbytes)  # None without O_DIRECT: through the page cache
        if buf is None:  # pread: the read ahead may run beside a read of the caller's thread
            buf = bytearray(nbytes)
            got = pread_into(self.f.fileno(), memoryview(buf), offset)
        else:
            got = len(buf)
        if got != nbytes:
            raise CheckpointDataError(f"{self.path}: truncated in {NAMES[k]} of elements {e['start']}..{e['end']}")
        return buf

    def _check(self, crc: int, e, k: int) -> None:
        if crc != e["crc"][k]:
            raise CheckpointDataError(
                f"{self.path}: checksum mismatch in {NAMES[k]} of elements {e['start']}..{e['end']}; "
                f"the checkpoint is corrupt and was not used")

    def drop_cached(self) -> None:
        self._cached = {}

    def close(self) -> None:
        if self._ahead_thread is not None:
            self._ahead_thread.shutdown(wait=True)
            self._ahead_thread, self._ahead = None, None
        self._direct.close()
        if self._owns_file:
            self.f.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def human_bytes(n: float) -> str:
    return f"{n / 1e9:,.2f} GB" if n >= 1e8 else f"{n / 1e6:,.2f} MB"

