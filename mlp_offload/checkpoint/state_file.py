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

A subgroup the save took by hard link from its tier file has, instead of an offset and tensor CRCs, a
``part``: its tensors' places in that file and the tier's block CRCs of them (``parts``).

A master stored as remainders (``remainders``) is saved so (tagged ``rem16`` in the footer's
dtypes): the model checkpoint of the same step holds its high halves, the bf16 params.

Loading is by element range, independent of how the saving engine was split into subgroups or
where its state lived: a run may resume with other tier paths, host budget or subgroup size, or
other state dtypes (each tensor is widened or rounded to the engine's as it is copied in).
"""

from __future__ import annotations

import json
import logging
import os
import zlib
from typing import List, Optional, Tuple

import torch

from ..engine import OffloadedAdamW
from ..state_formats import codec_for_tag, codecs_for, is_blockwise, state_bytes
from .file_blocks import FileBlocks, note_moments_change, values_fill
from .file_format import MAGIC, NAMES, TRAILER, CheckpointDataError
from .link_in import PartsIntoTiers
from .parts import check_part
from .range_reader import RangeReader

log = logging.getLogger("mlp_offload")


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
        in_part = isinstance(e, dict) and "part" in e  # its tensors lie in a part file (``parts``)
        if not (isinstance(e, dict) and all(_is_count(e.get(k)) for k in ("start", "end", "offset"))
                and (in_part or (isinstance(e.get("crc"), list) and len(e["crc"]) == len(NAMES)
                                 and all(_is_count(c) for c in e["crc"])))):
            raise bad(f"malformed subgroup entry {str(e)[:80]}")
        if e["start"] != expected_start or e["end"] <= e["start"] or e["offset"] != expected_offset:
            raise bad(f"subgroup {e['start']}..{e['end']} at byte {e['offset']}, expected to start at element "
                      f"{expected_start} and byte {expected_offset}")
        if blocks is not None:
            _check_entry_blocks(e, blocks, bad)
        expected_start = e["end"]
        if in_part:
            check_part(e["part"], [c.stored_bytes(e["end"] - e["start"], e.get("blocks")) for c in codecs], bad)
        else:
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


def load_engine_state(engine: OffloadedAdamW, path: str, link_parts: bool = True) -> dict:
    """Fill the engine from ``path`` (CRC-checked before use); returns the saved metadata.
    ``link_parts``: see ``fill_engine``."""
    with StateFile(path) as saved:
        fill_engine(engine, saved, link_parts=link_parts)
        return saved.metadata


def fill_engine(engine: OffloadedAdamW, saved: StateFile, notice: bool = True, observe=None,
                link_parts: bool = True) -> None:
    """Fill the engine with the whole of an opened state file (the same shard, saved at this layout).
    ``notice``: warn in one line where the moments change format (a caller of many ranks says it once).
    ``observe``: wraps the fill callback (``digest.StateDigest.observing``: what was written is digested).
    ``link_parts``: part files that are exactly what the engine's file tier would hold for one of its
    subgroups become that tier's file by hard link (``link_in``), neither read nor written; with
    ``observe`` they are still read once, from the tier, for the digest (a read, not a read and a write);
    without, their block CRCs are checked by the tier's first read of them, not by the load."""
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

    callback = fill if as_stored else values_fill(engine, fill)
    parts = PartsIntoTiers(engine, saved) if link_parts else None
    if parts is not None:
        reader.leave_out(e["start"] for e in parts.planned.values())
    engine.load_state(callback if observe is None else observe(callback), steps_done=footer["steps_done"],
                      stored=saved_remainders, adopt=parts.adopt if parts is not None else None,
                      read_adopted=observe)
    linked = parts.linked_bytes if parts is not None else 0
    read = subgroups_file_bytes(engine.subgroups) - linked + (linked if observe is not None else 0)
    log.info("offloaded state %s: %s linked into the tiers' files, %s read", path, human_bytes(linked),
             human_bytes(read))


def human_bytes(n: float) -> str:
    return f"{n / 1e9:,.2f} GB" if n >= 1e8 else f"{n / 1e6:,.2f} MB"

