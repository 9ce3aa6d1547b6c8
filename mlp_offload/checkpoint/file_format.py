"""The checkpoint file's fixed parts (``state_file`` describes the layout): its magic and trailer, the names of
a subgroup's three tensors, its name's suffix, and the two errors a reader or writer raises."""

from __future__ import annotations

import struct

MAGIC = b"MLPOFFv2"
TRAILER = struct.Struct("<8sQI")  # magic, footer length, CRC32 of the footer
NAMES = ("param", "exp_avg", "exp_avg_sq")
SUFFIX = ".offload"  # a state file's name ends so; it checks itself (footer and tensor CRCs)


class CheckpointDataError(RuntimeError):
    """A checkpoint file is missing, truncated, corrupt or does not fit this engine."""


class CheckpointSaveError(RuntimeError):
    """A checkpoint file could not be written (e.g. the file system is full); nothing partial is left."""
