"""Value types of command-line flags: each refuses a bad value with a message argparse puts after the
flag's name (``argument --lr: must be >= 0, got -1``). A leaf module: the flags' table
(``offload.options``) and ``errors`` both import it."""

from __future__ import annotations

import argparse
import math


def finite(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):
        raise argparse.ArgumentTypeError(f"must be a finite number, got {text}")
    return value


def positive_float(text: str) -> float:
    value = finite(text)
    if not value > 0:
        raise argparse.ArgumentTypeError(f"must be > 0, got {text}")
    return value


def positive_int(text: str) -> int:
    value = int(text)
    if value <= 0:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {text}")
    return value


def non_negative_int(text: str) -> int:
    value = int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {text}")
    return value


def non_negative_float(text: str) -> float:
    value = finite(text)
    if not value >= 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {text}")
    return value


def fraction(text: str) -> float:
    value = finite(text)
    if not 0.0 <= value <= 1.0:
        raise argparse.ArgumentTypeError(f"must be in [0, 1], got {text}")
    return value


def only(value: str, what: str):
    """The type of a Megatron-LM flag of which one value is built here: ``value``; any other is refused
    with ``what`` (what that one value is)."""
    def the_one(text: str) -> str:
        if text != value:
            raise argparse.ArgumentTypeError(f"{text!r} is not built here: only {value} ({what})")
        return text
    the_one.__name__ = f"{value}_only"
    return the_one
