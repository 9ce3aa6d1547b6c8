"""CRC32s fed a stored tensor's bytes piece by piece, in order, as its reads land (``DirectReads.read``'s
``feed``): one CRC of the whole tensor (a state file's), or one per block of a tier's (a part file's). Any
cutting of the bytes into pieces gives the same CRCs."""

from __future__ import annotations

import zlib
from typing import List


class ChainedCrc:
    """The CRC32 of every byte fed, chained onto ``value``."""

    def __init__(self, value: int = 0):
        self.value = value

    def feed(self, piece) -> None:
        self.value = zlib.crc32(piece, self.value)


class BlockCrcs:
    """The CRC32 of each ``block`` bytes fed (the last block may be shorter): ``values`` once all are fed."""

    def __init__(self, block: int):
        self.block = block
        self.done: List[int] = []
        self._crc, self._filled = 0, 0  # the block being fed

    def feed(self, piece) -> None:
        view = memoryview(piece)
        while len(view):
            take = min(len(view), self.block - self._filled)
            self._crc = zlib.crc32(view[:take], self._crc)
            self._filled += take
            view = view[take:]
            if self._filled == self.block:
                self.done.append(self._crc)
                self._crc, self._filled = 0, 0

    @property
    def values(self) -> List[int]:
        return self.done + ([self._crc] if self._filled else [])
