"""What one rank gets of what the node's ranks share: a streamed device update moves each element's
stored state host -> device and back, so its rate is bounded by the rank's own link and by its share
of the node's host memory bandwidth, which the node's ranks use at once (data, tensor and pipeline
parallel ranks all update in the same phase).

One GPU alone streams at its link's rate in bytes, whatever the stored bytes per element; the GPUs of
one node streaming at once each got well under what each had probed alone: the node's host memory
bandwidth bound them (docs/design.md, "Rates, tokens and the prediction")."""

from __future__ import annotations

from typing import Optional


def streamed_elems_per_s(state_bytes_per_elem: float, link_bps: float, ranks_per_node: int = 1,
                         node_host_bps: Optional[float] = None, alone_elems_per_s: Optional[float] = None) -> float:
    """Elements per second one rank's streamed update reaches: the slower of its link and its share
    of the node's host bandwidth (``node_host_bps`` / ``ranks_per_node``), each moving
    2 x ``state_bytes_per_elem`` per element; ``alone_elems_per_s`` (a measured one-rank rate, e.g.
    the engine's start-up probe) replaces the link's bound where given."""
    moved = 2 * state_bytes_per_elem
    rate = alone_elems_per_s if alone_elems_per_s else link_bps / moved
    if node_host_bps:
        rate = min(rate, node_host_bps / ranks_per_node / moved)
    return rate
