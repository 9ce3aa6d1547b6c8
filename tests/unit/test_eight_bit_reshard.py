"""8-bit moments read by parameter name for another DP size (offloaded_state): a parameter split
over the files of several DP ranks at any cuts, read back as any piece under that piece's own
blocks. The reference (numpy): every block of the new piece that is a block of one old file (both
its ends block boundaries there) keeps that file's codes and scale, bit for bit; every other block
is the old file's values dequantized and quantized again as one block. Old files with fp32 moments
give every block quantized from the exact values. Quantizing a dequantized block again mostly gives
its bits back, so the bits alone rarely tell a move from a requantization: the reads tell (with every
cut on a block boundary no moment is read as values)."""

from unittest import mock

import numpy as np
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.profiles import examples

from megatron.training.checkpoint.offload_files import offload_file_path
from megatron.training.checkpoint.offloaded_state import SavedOffloadState
from mlp_offload import ModelLink, OffloadedAdamW
from mlp_offload.checkpoint import RangeReader, values_fill
from mlp_offload.checkpoint.write import save_engine_state
from mlp_offload.kernels.blockwise8 import BlockLayout, Quantized

from .helpers import fast_config
from .test_blockwise8 import F32, bits, ref_blocks, ref_dequantize, ref_quantize
from .test_eight_bit_engine import CODECS, FP8

NUMEL, B = 1000, 128  # one parameter "0.w"


def _save_split(root, full, cuts, fp8: bool):
    """One DP rank's file per piece of ``full`` (master, exp_avg, exp_avg_sq) cut at ``cuts``."""
    bounds = [0, *cuts, NUMEL]
    (root / "iter" / "offload").mkdir(parents=True, exist_ok=True)
    for dp, (a, b) in enumerate(zip(bounds, bounds[1:])):
        cfg = fast_config(root / f"e{dp}", tiers=["host"], subgroup_size=300,
                          state_dtypes=FP8 if fp8 else ("fp32",) * 3)
        with OffloadedAdamW(torch.zeros(b - a), cfg, model=ModelLink(param_segments=[(0, a, b - a)])) as eng:
            def fill(sg, *outs):
                for out, whole in zip(outs, full):
                    out.copy_(whole[a + sg.start: a + sg.end])

            eng.load_state(values_fill(eng, fill), steps_done=3)
            meta = {"dp_size": len(bounds) - 1, "params": [["0.w", a, b - a, 0]], "geometry": {}, "model_chunks": 1,
                    "ep_size": 1}
            save_engine_state(eng, offload_file_path(str(root / "iter"), 0, 0, dp), meta)


def _expected(full, cuts, start, end, fp8: bool):
    """Per moment (codes as uint8, each element's scale) of piece [start, end) by the rule above."""
    bounds = [0, *cuts, NUMEL]
    old_blocks = ref_blocks([(a, a, b - a) for a, b in zip(bounds, bounds[1:])], B)
    new_blocks = ref_blocks([(0, start, end - start)], B)
    out = []
    for k, codec in enumerate(CODECS, 1):
        fmt, value = codec.fmt, full[k].numpy()
        if fp8:
            stored = np.sqrt(value.astype(np.float64)).astype(F32) if fmt.root else value
            old_codes, old_scales = ref_quantize(stored, old_blocks, fmt)
            value = ref_dequantize(old_codes, old_scales, old_blocks, fmt)
        codes, scales = np.zeros(end - start, np.uint8), np.zeros(end - start, F32)
        for j in np.unique(new_blocks):
            idx = np.nonzero(new_blocks == j)[0]
            p, q = start + idx[0], start + idx[-1] + 1
            same = fp8 and len(np.unique(old_blocks[p:q])) == 1 and (p == 0 or old_blocks[p - 1] != old_blocks[p]) \
                and (q == NUMEL or old_blocks[q] != old_blocks[q - 1])
            if same:  # one whole old block: as it was
                codes[idx], scales[idx] = old_codes[p:q], old_scales[old_blocks[p]]
            else:
                part = value[p:q]
                part = np.sqrt(part.astype(np.float64)).astype(F32) if fmt.root else part
                c, s = ref_quantize(part, np.zeros(q - p, np.int64), fmt)
                codes[idx], scales[idx] = c, s[0]
        out.append((codes, scales))
    return out


@st.composite
def cuts_and_piece(draw):
    """Old DP cuts (block-aligned or not) and the new piece [start, end)."""
    aligned = draw(st.booleans())
    points = st.integers(1, (NUMEL - 1) // B).map(lambda j: j * B) if aligned else st.integers(1, NUMEL - 1)
    cuts = sorted(draw(st.sets(points, min_size=1, max_size=3)))
    ends = sorted(draw(st.sets(st.sampled_from([0, NUMEL, *range(B, NUMEL, B)]) if aligned
                               else st.integers(0, NUMEL), min_size=2, max_size=2)))
    return cuts, ends[0], ends[1]


@settings(max_examples=examples(30), deadline=None, derandomize=True)
@given(case=cuts_and_piece(), fp8=st.booleans(), seed=st.integers(0, 3))
def test_moments_read_by_name_keep_whole_blocks_and_requantize_only_cut_ones(tmp_path_factory, case, fp8, seed):
    cuts, start, end = case
    root = tmp_path_factory.mktemp("split8")
    gen = torch.Generator().manual_seed(seed)
    full = [torch.randn(NUMEL, generator=gen), torch.randn(NUMEL, generator=gen) * 1e-3,
            torch.rand(NUMEL, generator=gen) * 1e-5]
    _save_split(root, full, cuts, fp8)
    layout = BlockLayout([(0, start, end - start)], B)
    targets = [Quantized.zeros(layout, codec.fmt) for codec in CODECS]
    value_reads = []  # moments read as values (requantized), by element range
    read = RangeReader.read

    def counting_read(reader, k, a, b, out):
        if k:
            value_reads.append((a, b))
        return read(reader, k, a, b, out)

    with SavedOffloadState(str(root / "iter"), steps_done=3) as saved, \
            mock.patch.object(RangeReader, "read", counting_read):
        saved.position("dense", 0, 0).read_moments_by_name("0.w", start, end, targets, layout)
    if fp8 and all(c % B == 0 for c in (*cuts, start)) and end in (NUMEL, end // B * B):
        assert value_reads == []  # every cut on a block boundary: codes and scales moved, none requantized
    elif not fp8:
        assert sum(b - a for a, b in value_reads) == 2 * (end - start)
    index = layout.block_index("cpu")
    for target, (codes, scales) in zip(targets, _expected(full, cuts, start, end, fp8)):
        assert np.array_equal(bits(target.codes), codes)
        assert np.array_equal(bits(target.scales[index]), scales.view(np.uint32))
