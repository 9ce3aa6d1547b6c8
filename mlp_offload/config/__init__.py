"""config/: the engine's configuration, a pure function of its arguments: ``OffloadConfig`` (every
knob, validated when built: offload_config; its device fields in device_checks), the file tiers'
bandwidths (bandwidth), what a valid value is (checks), the storage alignment sizes are checked
against (align) and the byte units (units). It imports only the engine's state formats and the
tiers' kinds (``tiers.kinds``, which imports nothing of the engine); every other engine module may
import it."""

from .bandwidth import TierBandwidth, parse_bandwidths, probe_piece_bytes
from .checks import OffloadConfigError
from .device_checks import UPDATE_SIDES
from .offload_config import GPU_TIER, HOST_TIER, RESIDENT_TIERS, TOKEN_SCOPES, OffloadConfig

__all__ = ["OffloadConfig", "OffloadConfigError", "TierBandwidth", "parse_bandwidths", "probe_piece_bytes",
           "GPU_TIER", "HOST_TIER", "RESIDENT_TIERS", "TOKEN_SCOPES", "UPDATE_SIDES"]
