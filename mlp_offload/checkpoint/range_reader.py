"""Reading element ranges of one state tensor from a checkpoint file (``state_file``'s layout): each stored tensor
CRC-checked before its data is used, widened or rounded to the caller's dtype, 8-bit moments as values or as
codes and scales, the next tensor read ahead on a thread of its own."""

from __future__ import annotations

import zlib
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Dict, List, Optional, Set, Tuple

import torch

from ..tiers.direct_io import DirectReads, pread_into
from ..kernels.blockwise8 import Quantized, dequantize
from ..state_formats import FP32_STATE, REMAINDERS16, codecs_for, is_blockwise, state_bytes
from .file_blocks import FileBlocks
from .file_format import NAMES, CheckpointDataError
from .crcs import BlockCrcs, ChainedCrc
from .parts import PartSources, part_mismatch


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
    disk's pace rather than at read + CRC + copy one after the other.

    A subgroup held in a part file (``parts``) is read from that file, each tensor's span checked
    against the tier's block CRCs the footer records instead of one CRC of the tensor."""

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
        self._parts = PartSources(path)
        self._successor = _successors(self.entries)
        self._last: Optional[Tuple[int, int]] = None
        self._ahead: Optional[Tuple[Tuple[int, int], Future]] = None
        self._ahead_thread: Optional[ThreadPoolExecutor] = None
        self.read_ahead_used = 0  # stored tensors that came from the read ahead

    def leave_out(self, starts) -> None:
        """The stored subgroups starting at ``starts`` will not be read (a load links their part files
        in): the read ahead passes over them."""
        skipped = set(starts)
        self._successor = _successors([e for e in self.entries if e["start"] not in skipped])

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

    def stored_bytes(self, e, k: int) -> bytes:
        """Stored tensor ``k`` of footer entry ``e`` as it lies in the checkpoint (its check passed)."""
        buf, crc = self._read_and_crc(e, k)
        self._check(crc, e, k)
        return bytes(buf)

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
        """The stored tensor's bytes and their check: the CRC32 of the tensor, or a part's block CRCs."""
        if "part" in e:
            part = e["part"]
            blocks = BlockCrcs(part["block"])
            buf = self._parts.read(e, k, 0, part["spans"][k][1], blocks.feed)
            return memoryview(buf)[: self._region_bytes(e, k)], blocks.values
        return self._raw_and_crc(e, k, 0, self._region_bytes(e, k))

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
        if "part" in e:  # block by block, as the tier wrote it
            part = e["part"]
            span, block = part["spans"][k][1], part["block"]
            self._check([zlib.crc32(self._parts.read(e, k, a, min(span, a + block) - a)) for a in range(0, span, block)],
                        e, k)
            self._verified.add((e["start"], k))
            return
        crc, size = 0, self._region_bytes(e, k)
        step = max(self.codecs[k].bytes_per_element, self.cache_bytes // 6)
        step -= step % self.codecs[k].bytes_per_element
        for at in range(0, size, step):
            crc = self._raw_and_crc(e, k, at, min(size, at + step) - at, crc)[1]
        self._check(crc, e, k)
        self._verified.add((e["start"], k))

    def _bytes(self, e, k: int, lo: int, hi: int) -> bytearray:
        """Elements [lo, hi) of element-wise stored tensor ``k`` of subgroup entry ``e``, as stored."""
        itemsize = self.codecs[k].bytes_per_element
        return self._raw(e, k, itemsize * (lo - e["start"]), itemsize * (hi - lo))

    def _raw(self, e, k: int, at: int, nbytes: int) -> bytearray:
        """Bytes ``[at, at + nbytes)`` of stored tensor ``k``'s region in subgroup entry ``e``."""
        if "part" in e:
            return self._parts.read(e, k, at, nbytes)
        return self._raw_and_crc(e, k, at, nbytes, crc=None)[0]

    def _raw_and_crc(self, e, k: int, at: int, nbytes: int, crc: Optional[int] = 0):
        """``_raw``'s bytes of this file (not a part's) and their CRC32 chained onto ``crc`` (None: no CRC,
        0 given back), taken as the reads land (``DirectReads.read``)."""
        n = e["end"] - e["start"]
        offset = e["offset"] + state_bytes(self.codecs[:k], n, e.get("blocks")) + at
        chained = None if crc is None else ChainedCrc(crc)
        buf = self._direct.read(offset, nbytes, None if chained is None else chained.feed)  # None: no O_DIRECT
        if buf is None:  # pread: the read ahead may run beside a read of the caller's thread
            buf = bytearray(nbytes)
            got = pread_into(self.f.fileno(), memoryview(buf), offset)
            if chained is not None:
                chained.feed(buf)  # zlib lets go of the GIL for a buffer this size
        else:
            got = len(buf)
        if got != nbytes:
            raise CheckpointDataError(f"{self.path}: truncated in {NAMES[k]} of elements {e['start']}..{e['end']}")
        return buf, (0 if chained is None else chained.value)

    def _check(self, crc, e, k: int) -> None:
        if "part" in e:
            at = part_mismatch(e, k, crc)
            if at is not None:
                raise CheckpointDataError(
                    f"{self._parts.path_of(e)}: checksum mismatch in {NAMES[k]} of elements {e['start']}..{e['end']} "
                    f"(the block at byte {e['part']['spans'][k][0] + at} of this part file); the checkpoint is "
                    f"corrupt and was not used")
            return
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
        self._parts.close()
        if self._owns_file:
            self.f.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def _successors(entries) -> Dict[Tuple[int, int], Tuple[dict, int]]:
    """(start, tensor) -> the stored tensor after it in the file, which the read ahead reads next. A
    part's entry takes no bytes of the file: it sits at the next entry's offset, in element order."""
    by_offset = [(e, k) for e in sorted(entries, key=lambda e: (e["offset"], e["start"])) for k in range(3)]
    return {(e["start"], k): nxt for (e, k), nxt in zip(by_offset, by_offset[1:])}
