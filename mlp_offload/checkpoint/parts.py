"""Part files: subgroups a checkpoint holds by hard link to their tier file instead of a copy of its bytes.

Where a subgroup's current state is a tier file on the checkpoint's own file system, the save gives
that file a second name, ``<state file>.parts/<save id>/<key>``, and the state file's footer records
for the subgroup, instead of a byte offset and three tensor CRCs, a ``part``: the file's name
relative to the state file's directory, where each of the three tensors lies in it (``spans``: byte
offset and padded length of the tier's region), and the tier's block size and block CRC32s over
each region (``block``, ``crcs``). The tier never writes into a linked file again (its next write
of the subgroup goes to a new file), so the part keeps the bytes the save saw; deleting the tier or
the checkpoint removes one name of the file, never the other's bytes, and a ``cp -r`` of the
checkpoint copies the part like any file.

A save's parts go in a directory of its own (the save id), which the state file's rename commits:
a crash before the rename leaves the old state file with its own parts; after it, the parts of
other saves at that path are removed. A reader checks a part's block CRCs before using its data.
"""

from __future__ import annotations

import errno
import logging
import os
import secrets
import shutil
from typing import Dict, List, Optional

from ..tiers.direct_io import DirectReads, pread_into
from ..tiers.files import fsync_path
from .file_format import NAMES, CheckpointDataError

log = logging.getLogger("mlp_offload")

PARTS_SUFFIX = ".parts"
# What a file system says when it will not give a file a second name here: copy the bytes instead.
LINK_REFUSED = (errno.EXDEV, errno.EPERM, errno.EMLINK, errno.EOPNOTSUPP)


def parts_dir(path: str) -> str:
    """The directory beside state file ``path`` that holds its saves' part directories."""
    return path + PARTS_SUFFIX


def is_part_path(rel: str) -> bool:
    """Whether a path inside a checkpoint is a part file (which checks itself, as a state file does)."""
    return any(piece.endswith(PARTS_SUFFIX) for piece in rel.split(os.sep)[:-1])


class PartLinks:
    """One save's part files: links made (``link``), made durable (``sync``), then kept with the
    committed state file (``commit_done``: other saves' parts go) or removed (``discard``)."""

    def __init__(self, path: str, steps_done: int):
        self.path = path
        self.base = os.path.dirname(os.path.abspath(path))
        self.device = os.stat(self.base).st_dev
        self.save_dir = f"step{steps_done}-{secrets.token_hex(4)}"
        self.files: List[str] = []
        self.refused: set = set()  # tiers whose file system refused a link: copied from then on
        self.linked_bytes = 0

    @property
    def dir(self) -> str:
        return os.path.join(parts_dir(self.path), self.save_dir)

    def link(self, tier, key: str, sg) -> Optional[dict]:
        """Link tier ``tier``'s file ``key`` (subgroup ``sg``'s current state) in as a part; returns the
        footer's ``part`` for it, or None where it must be copied (another file system, a tier
        without block CRCs, a link refused)."""
        crcs = _tier_crcs(tier, key)
        if crcs is None or tier.name in self.refused:
            return None
        source = tier.path_of(key)
        try:
            if os.stat(source).st_dev != self.device:
                return None
            spans, by_region = _regions(sg, tier.block_bytes, crcs)
            if spans is None:
                return None
            os.makedirs(self.dir, exist_ok=True)
            name = os.path.basename(key)
            tier.link_out(key, os.path.join(self.dir, name))
        except OSError as err:
            if err.errno not in LINK_REFUSED:
                raise
            self.refused.add(tier.name)
            log.warning("tier %s: the file system refused a hard link into the checkpoint (%s): its subgroups "
                        "are copied", tier.name, err.strerror or err)
            return None
        self.files.append(os.path.join(self.dir, name))
        self.linked_bytes += sg.state_bytes
        rel = os.path.relpath(os.path.join(self.dir, name), os.path.dirname(os.path.abspath(self.path)))
        return {"file": rel, "spans": spans, "block": tier.block_bytes, "crcs": by_region}

    def sync(self) -> None:
        """Make the part files and their directory entries durable (before the state file is renamed)."""
        if not self.files:
            return
        for name in self.files:
            fsync_path(name)
        fsync_path(self.dir)
        fsync_path(parts_dir(self.path))
        fsync_path(os.path.dirname(parts_dir(self.path)))

    def commit_done(self) -> None:
        """The state file now names this save's parts: remove the parts of any other save at its path."""
        root = parts_dir(self.path)
        try:
            others = [d for d in os.listdir(root) if d != self.save_dir or not self.files]
        except FileNotFoundError:
            return
        for d in others:
            shutil.rmtree(os.path.join(root, d), ignore_errors=True)
        if not self.files:
            _rmdir(root)

    def discard(self) -> None:
        """The save failed: its parts go (the tier keeps its own names)."""
        if self.files or os.path.isdir(self.dir):
            shutil.rmtree(self.dir, ignore_errors=True)
            _rmdir(parts_dir(self.path))


def _tier_crcs(tier, key: str) -> Optional[List[int]]:
    """The tier's block CRCs of ``key``: None for a tier that keeps none (nothing to check a part by)."""
    if not hasattr(tier, "link_out") or not getattr(tier, "verify_checksums", False):
        return None
    return tier.block_crcs(key)


def _regions(sg, block: int, crcs: List[int]):
    """Each tensor's (offset, padded length) in the tier file and its blocks' CRCs, or (None, None)
    where the CRCs do not cover the three regions block by block (not written as one subgroup)."""
    spans, by_region, at = [], [], 0
    for k in range(len(NAMES)):
        length = sg.region_bytes(k)
        count = -(-length // block)
        spans.append([sg.region_offset(k), length])
        by_region.append(crcs[at: at + count])
        at += count
    if at != len(crcs):
        return None, None
    return spans, by_region


def _rmdir(path: str) -> None:
    try:
        os.rmdir(path)
    except OSError:
        pass  # not empty (another save's parts) or gone


# -- reading ---------------------------------------------------------------------------------------
def check_part(part, stored_bytes: List[int], bad) -> None:
    """A footer's ``part``: a relative name inside the checkpoint, three spans each holding its stored
    tensor, one CRC per block of each; ``bad(why)`` makes the error raised otherwise."""
    if not isinstance(part, dict):
        raise bad(f"malformed part {str(part)[:80]}")
    name, spans, block, crcs = part.get("file"), part.get("spans"), part.get("block"), part.get("crcs")
    if not (isinstance(name, str) and name and not os.path.isabs(name) and os.path.normpath(name) == name
            and not name.startswith("..")):
        raise bad(f"part file name {str(name)[:80]!r} is not a path inside the checkpoint")
    if not (_is_count(block) and block > 0 and isinstance(spans, list) and isinstance(crcs, list)
            and len(spans) == len(crcs) == len(NAMES)):
        raise bad(f"malformed part of {name}")
    for span, region_crcs, need in zip(spans, crcs, stored_bytes):
        if not (isinstance(span, list) and len(span) == 2 and all(_is_count(v) for v in span) and span[1] >= need
                and isinstance(region_crcs, list) and len(region_crcs) == -(-span[1] // block)
                and all(_is_count(c) for c in region_crcs)):
            raise bad(f"part {name}: span {str(span)[:40]} with {str(region_crcs)[:40]} does not hold {need} bytes")


def _is_count(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


class PartSources:
    """The part files one reader reads, each opened at its first read (a handle and O_DIRECT reads)."""

    def __init__(self, state_path: str):
        self.base = os.path.dirname(os.path.abspath(state_path))
        self._open: Dict[str, tuple] = {}

    def path_of(self, e) -> str:
        return os.path.join(self.base, e["part"]["file"])

    def read(self, e, k: int, at: int, nbytes: int, feed=None):
        """Bytes ``[at, at + nbytes)`` of tensor ``k``'s span in entry ``e``'s part file; ``feed`` given them
        piece by piece as they land (``DirectReads.read``)."""
        path = self.path_of(e)
        if path not in self._open:
            try:
                f = open(path, "rb")
            except FileNotFoundError:
                raise CheckpointDataError(f"{path}: a part of the offloaded optimizer state is missing") from None
            self._open[path] = (f, DirectReads(path))
        f, direct = self._open[path]
        offset = e["part"]["spans"][k][0] + at
        buf = direct.read(offset, nbytes, feed)
        if buf is None:
            buf = bytearray(nbytes)
            got = pread_into(f.fileno(), memoryview(buf), offset)
            if feed is not None:
                feed(memoryview(buf)[:got])
        else:
            got = len(buf)
        if got != nbytes:
            raise CheckpointDataError(f"{path}: truncated in {NAMES[k]} of elements {e['start']}..{e['end']}")
        return buf

    def close(self) -> None:
        for f, direct in self._open.values():
            direct.close()
            f.close()
        self._open = {}


def part_mismatch(e, k: int, got: List[int]) -> Optional[int]:
    """The byte offset in the span of the first block whose CRC is not the footer's, or None."""
    part = e["part"]
    for i, (a, b) in enumerate(zip(got, part["crcs"][k])):
        if a != b:
            return i * part["block"]
    return None if len(got) == len(part["crcs"][k]) else len(got) * part["block"]
