"""The crash tests' fault and delay points (``mlp_offload``'s ``fault_point``), set from the
environment: ``MLP_OFFLOAD_FAULT="point[@rank][#n][=ERRNO]"`` and
``MLP_OFFLOAD_DELAY="point=SECONDS[,...]"`` (see the engine's ``faults`` module). The engine reads no
environment; this installer does, once per rank, before anything reaches a point."""

from __future__ import annotations

import os

from mlp_offload import configure_faults


def install_from_env() -> bool:
    """Configure this process's points; True when any is set."""
    fault, delay = os.environ.get("MLP_OFFLOAD_FAULT"), os.environ.get("MLP_OFFLOAD_DELAY")
    configure_faults(fault=fault, delay=delay, rank=int(os.environ.get("RANK", "0")))
    return bool(fault or delay)
