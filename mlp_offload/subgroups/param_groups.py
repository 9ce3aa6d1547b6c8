"""Hyperparameter groups over the flat shard, and how each subgroup is cut by them."""

from __future__ import annotations

from typing import List, Optional, Sequence, Tuple

from .partition import Subgroup

Range = Tuple[int, int]  # (start, end) element range of the shard that belongs to one group
# (local start, local end, group index, (offset in its range, range length)) of one subgroup piece
Segment = Tuple[int, int, int, Tuple[int, int]]


# AdamW's hyperparameters as torch.optim.AdamW names them, with its defaults; ``decoupled_weight_decay``
# False makes it Adam with L2 weight decay.
ADAMW_OPTIONS = dict(lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=1e-2, decoupled_weight_decay=True)


def adamw_options(given: dict) -> Tuple[dict, bool]:
    """(the param groups' defaults, whether weight decay is decoupled) from AdamW's keyword arguments."""
    unknown = sorted(set(given) - set(ADAMW_OPTIONS))
    if unknown:
        raise TypeError(f"unknown AdamW argument(s) {unknown}: AdamW takes {sorted(ADAMW_OPTIONS)}")
    options = {**ADAMW_OPTIONS, **given}
    defaults = dict(lr=options["lr"], betas=tuple(options["betas"]), eps=options["eps"],
                    weight_decay=options["weight_decay"])
    return defaults, options["decoupled_weight_decay"]


def build_groups(groups: Optional[Sequence[Tuple[Sequence[Range], dict]]], defaults: dict, numel: int) -> List[dict]:
    """torch.optim-style group dicts, each with its ``ranges``; ranges must lie in the shard and not overlap."""
    if groups is None:
        return [dict(defaults, ranges=[(0, numel)])]
    result, covered = [], []
    for ranges, options in groups:
        ranges = [(int(a), int(b)) for a, b in ranges]
        for a, b in ranges:
            if not 0 <= a < b <= numel:
                raise ValueError(f"param-group range ({a}, {b}) is outside the shard of {numel}")
        covered.extend(ranges)
        result.append(dict(defaults, **options, ranges=ranges))
    covered.sort()
    for (a0, b0), (a1, b1) in zip(covered, covered[1:]):
        if a1 < b0:
            raise ValueError(f"param-group ranges overlap: ({a0}, {b0}) and ({a1}, {b1})")
    return result


def segments_of(sg: Subgroup, param_groups: List[dict]) -> List[Segment]:
    """A subgroup's pieces in order; the span lets the fused kernel treat a cut range as one tensor."""
    segs = []
    for g, group in enumerate(param_groups):
        for a, b in group["ranges"]:
            lo, hi = max(a, sg.start), min(b, sg.end)
            if lo < hi:
                segs.append((lo - sg.start, hi - sg.start, g, (lo - a, b - a)))
    return sorted(segs)
