"""mlp_offload: multi-level, multi-path offload of optimizer state (usable without Megatron)."""

from .config import OffloadConfig, OffloadConfigError, TierBandwidth, parse_bandwidths
from .engine import OffloadedAdamW, OffloadStateError
from .placement import PlacementError
from .telemetry import StepRecord
from .tiers.files import TierDataError, TierIOError, TierPathError
from .tiers.host import HostMemoryError

__all__ = [
    "OffloadConfig", "OffloadConfigError", "TierBandwidth", "parse_bandwidths", "OffloadedAdamW",
    "OffloadStateError", "PlacementError", "StepRecord", "TierDataError", "TierIOError",
    "TierPathError", "HostMemoryError",
]
