"""The auto gpu tier's last growth (--offload-gpu-cache-gb auto), for the one line a job prints where NCCL fails soon
after: NCCL's buffers are allocated outside torch's allocator, so the margin the tier leaves beside the training's
peak (--offload-gpu-margin-gb) is all the room they find: a tier grown to within the margin can leave NCCL failing
("unhandled cuda error") in the next step (docs/benchmarks.md). The same failure elsewhere ("Failed to CUDA
calloc 8388608 bytes": torch's allocator keeps freed blocks cached, and NCCL, allocating lazily outside it, finds
the driver empty; pytorch/torchtitan#660, THUDM/slime#1086) is met by emptying the cache: the optimizer does so
after each growth. Process-wide: one device per rank."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Optional

from megatron.training.errors import explain_failures_with
from megatron.training.offload.options import GPU_MARGIN_FLAG

log = logging.getLogger("mlp_offload")
RECENT_STEPS = 2  # a failure this many steps after a growth is named with it; later ones are not


@dataclass
class Growth:
    tier_gib: float  # the tier after it grew
    left_gib: float  # the device's capacity less the peak the tier was sized against and the tier
    margin_gib: float  # --offload-gpu-margin-gb
    steps_since: int = 0


_last: Optional[Growth] = None
_allocator = None  # (reserved peak, in-use peak) bytes of the step the tier was last fitted to, on a GPU


def allocator_figures(reserved_peak: int, in_use_peak: int) -> None:
    """The caching allocator's peaks of the step just measured: where its reserve exceeds what was in use by more
    than the margin, the margin is not free for NCCL (a cause of the failures above)."""
    global _allocator
    _allocator = (reserved_peak, in_use_peak)


def observed(before_bytes: int, after_bytes: int, left_bytes: int, margin_bytes: int) -> None:
    """One step's fit of the auto tier: it grew from ``before_bytes`` to ``after_bytes``, leaving ``left_bytes``."""
    global _last
    if after_bytes > before_bytes:
        _last = Growth(after_bytes / 2**30, left_bytes / 2**30, margin_bytes / 2**30)
        if _allocator is not None:
            log.info("gpu tier grew: in the step it was fitted to, torch's allocator reserved up to %.2f GiB while "
                     "at most %.2f GiB was in use", _allocator[0] / 2**30, _allocator[1] / 2**30)
    elif _last is not None:
        _last.steps_since += 1


def forget() -> None:
    global _last, _allocator
    _last = _allocator = None


def nccl_hint(err: BaseException, margin_flag: str = GPU_MARGIN_FLAG) -> Optional[str]:
    """The line for an NCCL failure within ``RECENT_STEPS`` steps of the tier growing, else None."""
    text = str(err)
    if _last is None or _last.steps_since > RECENT_STEPS or "NCCL" not in text:
        return None
    first = text.strip().splitlines()[0] if text.strip() else type(err).__name__
    margin = _last.margin_gib
    return (f"NCCL failed ({first}) {_last.steps_since + 1} step(s) after the auto gpu tier grew to "
            f"{_last.tier_gib:.2f} GiB, leaving {_last.left_gib:.2f} GiB beside the training's peak "
            f"({margin_flag} {margin:g}): NCCL allocates outside torch's allocator and found no room; "
            f"rerun with {margin_flag} {2 * margin:g}")


explain_failures_with(nccl_hint)
