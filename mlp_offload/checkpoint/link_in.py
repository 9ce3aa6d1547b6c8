"""The load side of part files (``parts``): a saved subgroup held in a part file that is, byte for byte,
the file the loading engine's tier would write for its own subgroup becomes that tier file by hard link,
so the load neither reads it from the checkpoint nor writes it into the tier.

That takes the same element range, stored formats and (8-bit moments) blocks, the same regions at the
same offsets (the spans the tier's file of that subgroup has), the tier's block size with its checksums
on, the tier on the part's file system, and the subgroup's home that file tier (not a memory tier). The
tier then knows the footer's block CRCs as its own (its reads check them: a damaged part is found by
the first read, as a damaged tier file is), and writes the subgroup's next state to a new file, so the
checkpoint's bytes never change and deleting the checkpoint removes only its own name of the file.
Everything else, and a tier whose file system refuses the link, loads by reading and writing as before.
"""

from __future__ import annotations

import logging
import os
from typing import Dict, List, Optional

from ..state_formats import is_blockwise, state_bytes
from .parts import LINK_REFUSED

log = logging.getLogger("mlp_offload")


class PartsIntoTiers:
    """One load's part files to link into the engine's file tiers: ``planned`` (subgroup index -> its
    footer entry), each linked by ``adopt`` (an ``engine.load_state`` argument) when its turn comes."""

    def __init__(self, engine, saved):
        self.path = saved.path
        self.base = os.path.dirname(os.path.abspath(saved.path))
        self.planned: Dict[int, dict] = _plan(engine, saved, self.base)
        self.refused: set = set()  # tiers whose file system refused a link: read and written from then on
        self.linked_bytes = 0

    def adopt(self, i: int, sg, tier, key: str) -> bool:
        """Link subgroup ``i``'s part file in as ``tier``'s file ``key``; False where it is loaded as before."""
        e = self.planned.get(i)
        if e is None or tier.name in self.refused or not _tier_takes(tier, e["part"], self.source(e)):
            return False
        part = e["part"]
        try:
            tier.link_in(key, self.source(e), [c for region in part["crcs"] for c in region],
                         sum(length for _, length in part["spans"]))
        except OSError as err:
            if err.errno not in LINK_REFUSED:
                raise
            self.refused.add(tier.name)
            log.warning("tier %s: the file system refused a hard link of %s's part files (%s): they are read "
                        "and written", tier.name, self.path, err.strerror or err)
            return False
        self.linked_bytes += state_bytes(sg.codecs, sg.numel, sg.blocks)  # as a state file counts them
        return True

    def source(self, e: dict) -> str:
        return os.path.join(self.base, e["part"]["file"])


def _plan(engine, saved, base: str) -> Dict[int, dict]:
    """The engine's subgroups whose saved state is a part file its tier could have written itself."""
    footer = saved.footer
    codecs = engine.state_codecs
    if list(footer["dtypes"]) != [c.describe() for c in codecs]:
        return {}
    if is_blockwise(codecs) and not saved.blocks.same_as(engine.blocks.params, engine.blocks.block):
        return {}
    by_start = {e["start"]: e for e in footer["subgroups"] if "part" in e}
    tiers, tier_of = engine.file_tiers, engine.placement.tier_of
    planned = {}
    for i, sg in enumerate(engine.subgroups):
        e = by_start.get(sg.start)
        tier = tiers.get(tier_of[i])
        if (e is None or tier is None or e["end"] != sg.end or e.get("blocks") != sg.blocks
                or e["part"]["spans"] != _tier_spans(sg)):
            continue
        if _tier_takes(tier, e["part"], os.path.join(base, e["part"]["file"])):
            planned[i] = e
    return planned


def _tier_spans(sg) -> List[List[int]]:
    """Where the tier's file of ``sg`` holds each stored tensor: (offset, padded length) of its regions."""
    return [[sg.region_offset(k), sg.region_bytes(k)] for k in range(len(sg.codecs))]


def _tier_takes(tier, part: dict, source: str) -> bool:
    """Whether ``tier`` checks its files by blocks of the part's size and lies on the part's file system."""
    if not hasattr(tier, "link_in") or not getattr(tier, "verify_checksums", False) \
            or tier.block_bytes != part["block"]:
        return False
    try:
        return os.stat(tier.dir).st_dev == os.stat(source).st_dev
    except FileNotFoundError:
        return False  # a missing part: the read names it
