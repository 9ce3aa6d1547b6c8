"""ShardLayout.views finds the pieces overlapping a range by bisection (a step asks it per subgroup and per
param); it must give exactly the pieces a walk over all of them gives, empty pieces and edges included."""

import torch
from hypothesis import given, settings, strategies as st

from megatron.training.offload.shard_layout import Piece, ShardLayout
from tests.profiles import examples


class _Buffer:
    def __init__(self, n):
        self.param_data = torch.arange(n, dtype=torch.float32)
        self.grad_data = -self.param_data


def _layout(sizes):
    buffer = _Buffer(sum(sizes) + 7)
    pieces, flat, offset = [], 0, 3
    for size in sizes:
        pieces.append(Piece(buffer, offset, flat, size))
        flat, offset = flat + size, offset + size
    return ShardLayout.of_pieces(pieces)


def _walk(layout, start, end, kind):
    for p in layout.pieces:
        lo, hi = max(start, p.flat_start), min(end, p.flat_start + p.numel)
        if lo < hi:
            data = p.buffer.param_data if kind == "param" else p.buffer.grad_data
            yield lo, hi, data[p.buffer_start + lo - p.flat_start: p.buffer_start + hi - p.flat_start]


@settings(max_examples=examples(200), deadline=None, derandomize=True)
@given(sizes=st.lists(st.integers(0, 6), min_size=1, max_size=12), data=st.data())
def test_views_by_bisection_match_a_walk_over_every_piece(sizes, data):
    layout = _layout(sizes)
    start = data.draw(st.integers(0, layout.numel + 2))
    end = data.draw(st.integers(start, layout.numel + 3))
    for kind in ("param", "grad"):
        got = [(lo, hi, v.tolist()) for lo, hi, v in layout.views(start, end, kind)]
        want = [(lo, hi, v.tolist()) for lo, hi, v in _walk(layout, start, end, kind)]
        assert got == want
