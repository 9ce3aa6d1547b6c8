"""The shard cut for the engine: subgroups, each one's param-group pieces, and with 8-bit moments
their blocks (``blocks``)."""

from __future__ import annotations

from .blocks import SubgroupBlocks, shard_params_for
from .param_groups import segments_of
from .partition import partition


def cut_shard(numel: int, subgroup_size: int, codecs, param_groups, param_segments=None):
    """(subgroups, each one's param-group pieces, ``SubgroupBlocks`` or None): the shard cut for the
    engine; with 8-bit moments on block starts, ``param_segments`` placing the blocks."""
    if not any(c.block for c in codecs):
        subgroups = partition(numel, subgroup_size, codecs)
        return subgroups, [segments_of(sg, param_groups) for sg in subgroups], None
    params = shard_params_for(param_segments, [g["ranges"] for g in param_groups], numel)
    subgroups = partition(numel, subgroup_size, codecs, params)
    segments = [segments_of(sg, param_groups) for sg in subgroups]
    return subgroups, segments, SubgroupBlocks(params, subgroups, segments, max(c.block for c in codecs))
