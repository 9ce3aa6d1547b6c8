"""The CRCs a load takes as its reads land (mlp_offload.checkpoint.crcs): fed any cutting of the bytes, the
same as zlib's CRC32 of them whole (chained onto a given one), or of each block of them."""

import os
import zlib

from hypothesis import given, settings, strategies as st

from mlp_offload.checkpoint.crcs import BlockCrcs, ChainedCrc


@st.composite
def cut_bytes(draw):
    """Bytes and the places they are cut into pieces (empty pieces included)."""
    data = os.urandom(draw(st.integers(0, 5000)))
    cuts = sorted(draw(st.lists(st.integers(0, len(data)), max_size=8)))
    bounds = [0, *cuts, len(data)]
    return data, [data[a:b] for a, b in zip(bounds, bounds[1:])]


@settings(max_examples=200, deadline=None)
@given(cut_bytes(), st.integers(0, 2**32 - 1))
def test_a_chained_crc_fed_in_pieces_is_zlibs_of_the_whole(case, seed):
    data, pieces = case
    crc = ChainedCrc(seed)
    for piece in pieces:
        crc.feed(memoryview(piece))
    assert crc.value == zlib.crc32(data, seed)


@settings(max_examples=200, deadline=None)
@given(cut_bytes(), st.integers(1, 700))
def test_block_crcs_fed_in_pieces_are_zlibs_of_each_block(case, block):
    data, pieces = case
    crcs = BlockCrcs(block)
    for piece in pieces:
        crcs.feed(piece)
    assert crcs.values == [zlib.crc32(data[a: a + block]) for a in range(0, len(data), block)]
