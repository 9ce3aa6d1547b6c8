"""What a valid configuration value is, and the error that names the option of one that is not
(OffloadConfig's fields, the tiers' bandwidths)."""

from __future__ import annotations

import math


class OffloadConfigError(ValueError):
    """A configuration value is unknown, missing or contradictory. The message names the option."""


def is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)  # True would pass as 1


def positive_finite(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value) and value > 0


def positive(field: str, value: int) -> None:
    if not is_int(value) or value <= 0:
        raise OffloadConfigError(f"{field.replace('_', ' ')} ({field}) must be a positive integer, got {value!r}")
