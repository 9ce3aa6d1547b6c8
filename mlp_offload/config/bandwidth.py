"""File tiers' bandwidths: measured by the start-up's probe or given by the user
(``"nvme=3.0:2.8,pfs=1.0:0.8"``), and the probe's file size."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, Optional

from .align import ALIGN, align_down
from .checks import OffloadConfigError, positive_finite


@dataclass
class TierBandwidth:
    """Measured (or user-given) bandwidth of one file tier, in bytes per second."""

    read_bps: float
    write_bps: float
    mixed_bps: Optional[float] = None
    """Bytes/s read plus written while reads and writes run at once, as in the update (probed)."""
    shared_mixed_bps: Optional[float] = None
    """The same with as many streams as all the node's ranks issue at once (probed if they share)."""

    def __post_init__(self):
        for name in ("read_bps", "write_bps", "mixed_bps", "shared_mixed_bps"):
            value = getattr(self, name)
            if value is None and name in ("mixed_bps", "shared_mixed_bps"):
                continue
            # inf would plan I/O as free, nan would make every comparison in placement false
            if not positive_finite(value):
                raise OffloadConfigError(
                    f"tier bandwidth {name} must be a positive finite number of bytes/s, got {value!r}")

    def seconds(self, read_bytes: float, write_bytes: float) -> float:
        """Time to read and write that much on this tier alone. Reads and writes one after the
        other, unless the probe saw the device overlap them (mixed), which it then uses."""
        serial = read_bytes / self.read_bps + write_bytes / self.write_bps
        if self.mixed_bps is None:
            return serial
        return min(serial, (read_bytes + write_bytes) / self.mixed_bps)


def parse_bandwidths(spec: str) -> Dict[str, TierBandwidth]:
    """Parse ``"nvme=3.0:2.8,pfs=1.0:0.8"`` (read:write GB/s per tier, optionally :mixed, the GB/s
    read plus written while both run at once, as the probe reports it) into TierBandwidths."""
    result: Dict[str, TierBandwidth] = {}
    if not spec:
        return result
    for item in spec.split(","):
        try:
            name, rates = item.split("=")
            values = [float(x) * 1e9 for x in rates.split(":")]
            if len(values) not in (2, 3):
                raise ValueError
        except ValueError:
            raise OffloadConfigError(
                f"bandwidths {item!r}: expected TIER=READ_GBPS:WRITE_GBPS[:MIXED_GBPS], e.g. nvme=3.0:2.8"
            ) from None
        try:
            result[name.strip()] = TierBandwidth(*values)
        except OffloadConfigError as err:
            raise OffloadConfigError(f"bandwidths {item!r}: {err}") from None
    return result


def probe_piece_bytes(probe_bytes: int, prefetch_depth: int) -> int:
    """Bytes of each of the bandwidth probe's files: it moves ``probe_bytes`` as ``prefetch_depth``
    files at once, each whole pages and at least two (its mixed phase writes from one half while
    reading into the other)."""
    piece = align_down(probe_bytes // prefetch_depth)
    if piece < 2 * ALIGN:
        raise OffloadConfigError(
            f"the bandwidth probe cannot split probe_bytes={probe_bytes} into prefetch_depth={prefetch_depth} "
            f"files of at least {2 * ALIGN} bytes: raise probe_bytes to at least "
            f"{2 * ALIGN * prefetch_depth}, lower prefetch_depth, or give the "
            f"tier's bandwidths")
    return piece
