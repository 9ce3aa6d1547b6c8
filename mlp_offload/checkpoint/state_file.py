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

8-bit moments (``Blockwise8``: codes, then from the next multiple of 4 bytes one fp32 scale per
block) are saved as their regions, byte for byte; the footer then records the shard's param segments
and block size and each subgroup's block count (``file_blocks``), from which every region's size and
every range's blocks follow. A reader gives a range's codes and scales where both its ends are block
boundaries (``RangeReader.read_quantized``), and fp32 values of any range (``read``: the blocks
around it dequantized).

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
from ..kernels.blockwise8 import Quantized, dequantize
from ..state_formats import FP32_STATE, REMAINDERS16, codec_for_tag, codecs_for, is_blockwise, state_bytes
from .file_blocks import FileBlocks, note_moments_change, values_fill

MAGIC = b"MLPOFFv2"
TRAILER = struct.Struct("<8sQI")  # magic, footer length, CRC32 of the footer
NAMES = ("param", "exp_avg", "exp_avg_sq")


class CheckpointDataError(RuntimeError):
    """A checkpoint file is missing, truncated, corrupt or does not fit this engine."""


class CheckpointSaveError(RuntimeError):
    """A checkpoint file could not be written (e.g. the file system is full); nothing partial is left."""


def state_file_bytes(numel: int, codecs, blocks: Optional[int] = None) -> int:
    """Bytes of the tensors a state file holds (the footer, a few KB, comes on top); ``blocks``: the
    blocks of 8-bit moments (their layout's; default whole blocks from element 0)."""
    return state_bytes(codecs, numel, blocks)


def subgroups_file_bytes(subgroups) -> int:
    """Bytes of the tensors of a file holding ``subgroups`` (each with its own codecs and blocks)."""
    return sum(state_bytes(sg.codecs, sg.numel, sg.blocks) for sg in subgroups)


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
        self.blocks: Optional[FileBlocks] = FileBlocks.of_footer(footer)  # 8-bit moments' blocks

    @property
    def metadata(self) -> dict:
        return self.footer.get("metadata", {})

    def ranges(self, cache_bytes: Optional[int] = None) -> "RangeReader":
        reader = RangeReader(self.path, self.footer["subgroups"], stored_codecs(self.footer), cache_bytes, self.file,
                             self.blocks)
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
    blocks = _footer_blocks(footer, codecs, bad)
    expected_start, expected_offset = 0, 0
    for e in footer["subgroups"]:
        if not (isinstance(e, dict) and all(_is_count(e.get(k)) for k in ("start", "end", "offset"))
                and isinstance(e.get("crc"), list) and len(e["crc"]) == len(NAMES)
                and all(_is_count(c) for c in e["crc"])):
            raise bad(f"malformed subgroup entry {str(e)[:80]}")
        if e["start"] != expected_start or e["end"] <= e["start"] or e["offset"] != expected_offset:
            raise bad(f"subgroup {e['start']}..{e['end']} at byte {e['offset']}, expected to start at element "
                      f"{expected_start} and byte {expected_offset}")
        if blocks is not None:
            _check_entry_blocks(e, blocks, bad)
        expected_start = e["end"]
        expected_offset += state_file_bytes(e["end"] - e["start"], codecs, e.get("blocks"))
    if expected_start != numel:
        raise bad(f"subgroups cover {expected_start} of {numel} elements")
    if expected_offset != data_end:
        raise bad(f"the tensors end at byte {expected_offset} but the footer starts at byte {data_end}; truncated?")
    if not isinstance(footer.get("metadata", {}), dict):
        raise bad("metadata is not a mapping")


def _footer_blocks(footer: dict, codecs, bad) -> Optional[FileBlocks]:
    """The footer's blocks, required with 8-bit moments (and their block size the codecs')."""
    try:
        blocks = FileBlocks.of_footer(footer)
    except ValueError as err:
        raise bad(str(err)) from None
    if is_blockwise(codecs) != (blocks is not None) or (
            blocks is not None and any(c.block not in (0, blocks.block) for c in codecs)):
        raise bad(f"8-bit moments {[c.describe() for c in codecs]} with blocks {str(footer.get('blocks'))[:60]}")
    return blocks


def _check_entry_blocks(e: dict, blocks: FileBlocks, bad) -> None:
    """A subgroup of 8-bit moments ends on block starts and records the blocks its param segments make."""
    if not (blocks.is_boundary(e["start"]) and blocks.is_boundary(e["end"])):
        raise bad(f"subgroup {e['start']}..{e['end']} does not start and end on block starts")
    expected = blocks.count(e["start"], e["end"])
    if e.get("blocks") != expected:
        raise bad(f"subgroup {e['start']}..{e['end']} records {e.get('blocks')!r} blocks, its param segments "
                  f"make {expected}")


def _is_count(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def load_engine_state(engine: OffloadedAdamW, path: str) -> dict:
    """Fill the engine from ``path`` (CRC-checked before use); returns the saved metadata."""
    with StateFile(path) as saved:
        fill_engine(engine, saved)
        return saved.metadata


def fill_engine(engine: OffloadedAdamW, saved: StateFile, notice: bool = True) -> None:
    """Fill the engine with the whole of an opened state file (the same shard, saved at this layout).
    ``notice``: warn in one line where the moments change format (a caller of many ranks says it once)."""
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
    codecs = engine.state_codecs
    if notice:
        note_moments_change(path, reader.codecs, codecs)
    # 8-bit moments saved at this very shard move as stored (codes and scales, byte for byte); any
    # other pair of formats moves as values (``read`` dequantizes, ``values_fill`` quantizes).
    as_stored = is_blockwise(codecs) and reader.codecs[1:] == codecs[1:] and saved.blocks.same_as(
        engine.blocks.params, engine.blocks.block)

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
            if as_stored:
                reader.read_quantized(k, sg.start, sg.end, codecs[k].split(out, sg.numel, sg.blocks))
            else:
                reader.read(k, sg.start, sg.end, out)

    engine.load_state(fill if as_stored else values_fill(engine, fill), steps_done=footer["steps_done"],
                      stored=saved_remainders)


class RangeReader:
    """Reads element ranges of one state tensor across the stored subgroups of one file, widened or
    rounded to the dtype of ``out`` as they are copied. Each stored tensor is CRC-checked before any
    of its data is used; the two most recent stored subgroups stay cached, so ascending requests (a
    plain resume) read each once, other orders (resharding) may re-read. With ``cache_bytes`` a
    stored tensor larger than a sixth of it (two subgroups of three tensors) is not cached: its CRC is
    checked once by streaming it through a bounded buffer, then only the ranges asked for are read.

    8-bit moments (``blocks``: the file's ``FileBlocks``): ``read`` gives fp32 values (the blocks
    around the range dequantized), ``read_quantized`` a block-aligned range's codes and scales.

    While a stored tensor is checked and copied out, the next one in the file is read and checked on a
    thread of its own (where the requests follow the file, as a resume's do): a load then runs at the
    disk's pace rather than at read + CRC + copy one after the other."""

    def __init__(self, path: str, entries, codecs=None, cache_bytes: Optional[int] = None, file=None,
                 blocks: Optional[FileBlocks] = None):
        self.path = path
        self.entries = sorted(entries, key=lambda e: e["start"])
        self.codecs = codecs_for(FP32_STATE) if codecs is None else tuple(codecs)  # how each tensor is stored
        self.blocks = blocks
        if is_blockwise(self.codecs) and blocks is None:
            raise ValueError(f"{path}: 8-bit moments need the file's blocks to be read")
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

    def is_block_boundary(self, pos: int) -> bool:
        """Whether 8-bit moments may be cut at shard element ``pos`` without quantizing again."""
        return self.blocks is not None and self.blocks.is_boundary(pos)

    def read(self, k: int, start: int, end: int, out: torch.Tensor) -> None:
        codec = self.codecs[k]
        if codec.needs_high != (out.dtype == REMAINDERS16.storage_dtype):  # a remainder is no number
            raise CheckpointDataError(
                f"{self.path}: {NAMES[k]} is stored as 16-bit remainders of the model's bf16 params and cannot "
                f"be read as {out.dtype} (merging it needs the model's params of the same elements)")
        if codec.block and not out.dtype.is_floating_point:
            raise CheckpointDataError(f"{self.path}: {NAMES[k]} is stored in 8-bit blocks ({codec.describe()}): "
                                      f"read it as float values or with read_quantized, not as {out.dtype}")
        for e, lo, hi in self._pieces(start, end):
            target = out[lo - start: hi - start]
            if codec.block:
                target.copy_(self._dequantized(e, k, lo, hi))
            elif self._cacheable(e, k):
                target.copy_(self._stored(e, k)[lo - e["start"]: hi - e["start"]])
            else:
                self._verify(e, k)
                target.copy_(torch.frombuffer(self._bytes(e, k, lo, hi), dtype=codec.storage_dtype))

    def read_quantized(self, k: int, start: int, end: int, out: Quantized) -> None:
        """Codes and scales of 8-bit moment ``k``'s elements ``[start, end)``, both ends block
        boundaries of the file, into ``out`` (as many elements and blocks), unchanged."""
        if not self.codecs[k].block:
            raise CheckpointDataError(f"{self.path}: {NAMES[k]} is stored as {self.codecs[k].describe()}, not in "
                                      f"8-bit blocks")
        for end_ in (start, end):
            if not self.is_block_boundary(end_):
                raise CheckpointDataError(f"{self.path}: element {end_} is inside a block of {NAMES[k]}: its codes "
                                          f"cannot move unchanged")
        block_at = 0
        for e, lo, hi in self._pieces(start, end):
            first, last, part = self._quantized_blocks(e, k, lo, hi)
            n = last - first
            if part.codes.numel() != hi - lo or block_at + n > out.scales.numel():
                raise CheckpointDataError(f"{self.path}: elements {lo}..{hi} of {NAMES[k]} do not fit the blocks "
                                          f"asked for")
            out.codes[lo - start: hi - start].copy_(part.codes)
            out.scales[block_at: block_at + n].copy_(part.scales)
            block_at += n
        if block_at != out.scales.numel():
            raise CheckpointDataError(f"{self.path}: elements {start}..{end} of {NAMES[k]} make {block_at} blocks "
                                      f"in the file, {out.scales.numel()} were asked for")

    def _pieces(self, start: int, end: int):
        """(entry, lo, hi): the stored subgroups' parts of elements ``[start, end)``, in order."""
        pos = start
        for e in self.entries:
            lo, hi = max(pos, e["start"]), min(end, e["end"])
            if lo >= hi:
                continue
            yield e, lo, hi
            pos = hi
        if pos != end:
            raise CheckpointDataError(f"{self.path}: elements {pos}..{end} are not in the checkpoint")

    def _dequantized(self, e, k: int, lo: int, hi: int) -> torch.Tensor:
        """fp32 values of elements ``[lo, hi)`` of entry ``e``'s 8-bit moment ``k``."""
        first, last, part = self._quantized_blocks(e, k, lo, hi)
        layout = self.blocks.layout(e["start"], e["end"])
        at = int(layout.starts[first])
        return dequantize(part, layout.span(first, last))[lo - e["start"] - at: hi - e["start"] - at]

    def _quantized_blocks(self, e, k: int, lo: int, hi: int) -> Tuple[int, int, Quantized]:
        """The blocks ``[first, last)`` of entry ``e`` that hold elements ``[lo, hi)``, as stored."""
        layout = self.blocks.layout(e["start"], e["end"])
        starts = layout.starts
        first = int(torch.searchsorted(starts, lo - e["start"], right=True)) - 1
        last = int(torch.searchsorted(starts, hi - e["start"], right=False))
        a, b = int(starts[first]), int(starts[last])
        codec, n = self.codecs[k], e["end"] - e["start"]
        if self._cacheable(e, k):
            whole = codec.split(self._stored(e, k), n, e["blocks"])
            return first, last, Quantized(whole.codes[a:b], whole.scales[first:last], whole.fmt)
        self._verify(e, k)
        codes = self._raw(e, k, a, b - a)
        scales = self._raw(e, k, codec.stored_bytes(n, 0) + 4 * first, 4 * (last - first))
        return first, last, Quantized(torch.frombuffer(codes, dtype=codec.fmt.dtype),
                                      torch.frombuffer(scales, dtype=torch.float32), codec.fmt)

    def _region_bytes(self, e, k: int) -> int:
        return self.codecs[k].stored_bytes(e["end"] - e["start"], e.get("blocks"))

    def _cacheable(self, e, k: int) -> bool:
        return self.cache_bytes is None or 6 * self._region_bytes(e, k) <= self.cache_bytes

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
        buf = self._raw(e, k, 0, self._region_bytes(e, k))
        return buf, zlib.crc32(buf)  # zlib lets go of the GIL for a buffer this size

    def _read_ahead(self, key: Tuple[int, int]) -> None:
        nxt = self._successor.get(key)
        if nxt is None or (nxt[0]["start"], nxt[1]) in self._cached:
            return
        e, k = nxt
        if self.cache_bytes is not None and 7 * self._region_bytes(e, k) > self.cache_bytes:  # the bound holds it too
            return
        if self._ahead_thread is None:
            self._ahead_thread = ThreadPoolExecutor(1, thread_name_prefix="ckpt-read-ahead")
        self._ahead = ((e["start"], k), self._ahead_thread.submit(self._read_and_crc, e, k))

    def _verify(self, e, k: int) -> None:
        if (e["start"], k) in self._verified:
            return
        crc, size = 0, self._region_bytes(e, k)
        step = max(self.codecs[k].bytes_per_element, self.cache_bytes // 6)
        step -= step % self.codecs[k].bytes_per_element
        for at in range(0, size, step):
            crc = zlib.crc32(self._raw(e, k, at, min(size, at + step) - at), crc)
        self._check(crc, e, k)
        self._verified.add((e["start"], k))

    def _bytes(self, e, k: int, lo: int, hi: int) -> bytearray:
        """Elements [lo, hi) of element-wise stored tensor ``k`` of subgroup entry ``e``, as stored."""
        itemsize = self.codecs[k].bytes_per_element
        return self._raw(e, k, itemsize * (lo - e["start"]), itemsize * (hi - lo))

    def _raw(self, e, k: int, at: int, nbytes: int) -> bytearray:
        """Bytes ``[at, at + nbytes)`` of stored tensor ``k``'s region in subgroup entry ``e``."""
        n = e["end"] - e["start"]
        offset = e["offset"] + state_bytes(self.codecs[:k], n, e.get("blocks")) + at
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

