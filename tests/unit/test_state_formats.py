"""The stored state formats (mlp_offload.state_formats): each codec's pack and unpack against a
bit-level reference written here (bf16 round-to-nearest-even in integer arithmetic, fp16 through
numpy's own conversion, remainders as transformer-engine splits them), its stored bytes against the
packed tensors, and the registry's names, tags and refusals."""

import pickle

import numpy as np
import pytest
import torch
from hypothesis import given, settings, strategies as st

from mlp_offload.state_formats import (BF16, FP16, FP32, FP8_MOMENTS, REMAINDERS16, StateCodec, UnsupportedStateDtype,
                                       bytes_per_param, codec_for_tag, codec_named, codecs_for, dtype_name,
                                       forget, register, state_bytes)
from tests.profiles import examples

CODECS = (FP32, BF16, FP16, REMAINDERS16)
NAN_EXPONENT = 0x7F800000


def _not_nan(u: int) -> bool:
    return (u & NAN_EXPONENT) != NAN_EXPONENT or (u & 0x007FFFFF) == 0


def _not_nan_high(u: int) -> bool:
    """Its high half (the bf16 param a remainders master keeps) is not a NaN's."""
    return _not_nan(u & 0xFFFF0000)


patterns = st.lists(st.integers(0, 2**32 - 1), min_size=1, max_size=300)


def _fp32(bits) -> torch.Tensor:
    return torch.from_numpy(np.array(bits, dtype=np.uint32).view(np.float32).copy())


def _bits(t: torch.Tensor) -> np.ndarray:
    return t.numpy().view(np.uint32) if t.dtype == torch.float32 else t.view(torch.int16).numpy().view(np.uint16)


def ref_bf16_bits(u: np.ndarray) -> np.ndarray:
    """fp32 bits -> bf16 bits, rounded to nearest, ties to even (no NaNs)."""
    u = u.astype(np.uint64)
    return ((u + 0x7FFF + ((u >> 16) & 1)) >> 16).astype(np.uint16)


def ref_split(u: np.ndarray):
    """fp32 bits -> (int16 remainder, bf16 high bits), as transformer-engine's adam.cu: the low half
    as a signed remainder; the high half plus one where that is negative."""
    u = u.astype(np.int64)
    low, high = u & 0xFFFF, u >> 16
    rem = np.where(low >= 0x8000, low - 0x10000, low)
    return rem.astype(np.int16), ((high + (rem < 0)) & 0xFFFF).astype(np.uint16)


@settings(max_examples=examples(200))
@given(bits=patterns.map(lambda b: [u for u in b if _not_nan(u)]).filter(bool))
def test_float_codecs_pack_as_the_reference_rounds_and_unpack_exactly(bits):
    x = _fp32(bits)
    u = np.array(bits, dtype=np.uint32)
    assert np.array_equal(_bits(FP32.pack(x)), u)
    assert np.array_equal(_bits(BF16.pack(x)), ref_bf16_bits(u))
    assert np.array_equal(FP16.pack(x).numpy(), x.numpy().astype(np.float16))
    for codec in (FP32, BF16, FP16):
        stored = codec.pack(x)
        assert stored.dtype == codec.storage_dtype
        wide = codec.unpack(stored)
        assert wide.dtype == torch.float32
        # unpack is exact: bf16 bits are an fp32's high half; numpy widens fp16 exactly
        if codec is FP32:
            want = u
        elif codec is BF16:
            want = _bits(stored).astype(np.uint32) << 16
        else:
            want = stored.numpy().astype(np.float32).view(np.uint32)
        assert np.array_equal(_bits(wide), want)
        assert torch.equal(codec.pack(wide).view(torch.uint8), stored.view(torch.uint8))  # a fixed point


@settings(max_examples=examples(200))
@given(bits=patterns.map(lambda b: [u for u in b if _not_nan_high(u)]).filter(bool))
def test_remainders_split_as_the_reference_and_reconstruct_the_fp32_exactly(bits):
    x = _fp32(bits)
    before = x.clone()
    high = torch.empty(x.numel(), dtype=torch.bfloat16)
    rem = REMAINDERS16.pack(x, high=high)
    assert torch.equal(x.view(torch.int32), before.view(torch.int32))  # pack leaves its input alone
    want_rem, want_high = ref_split(np.array(bits, dtype=np.uint32))
    assert rem.dtype == torch.int16 and np.array_equal(rem.numpy(), want_rem)
    assert np.array_equal(_bits(high), want_high)
    back = REMAINDERS16.unpack(rem, high=high)
    assert np.array_equal(_bits(back), np.array(bits, dtype=np.uint32))
    out = torch.empty(x.numel(), dtype=torch.float32)  # into a given tensor: the same bits
    assert REMAINDERS16.unpack(rem, out, high=high) is out and torch.equal(out.view(torch.int32), back.view(torch.int32))


def test_remainders_need_the_high_halves_and_the_others_refuse_them():
    x = torch.randn(8)
    with pytest.raises(ValueError, match="rem16 needs the model's bf16 params"):
        REMAINDERS16.pack(x)
    with pytest.raises(ValueError, match="rem16 needs the model's bf16 params"):
        REMAINDERS16.unpack(torch.zeros(8, dtype=torch.int16))
    with pytest.raises(ValueError, match="bf16 takes no high halves"):
        BF16.unpack(BF16.pack(x), high=torch.zeros(8, dtype=torch.bfloat16))


@settings(max_examples=examples(50))
@given(numel=st.integers(0, 5000), which=st.lists(st.sampled_from(CODECS), min_size=3, max_size=3))
def test_stored_bytes_are_the_packed_tensors_bytes(numel, which):
    x = torch.randn(numel)
    high = torch.empty(numel, dtype=torch.bfloat16)
    packed = [c.pack(x, high=high if c.needs_high else None) for c in which]
    for codec, t in zip(which, packed):
        assert codec.stored_bytes(numel) == t.numel() * t.element_size() == codec.empty(numel).nbytes
        raw = torch.zeros(codec.stored_bytes(numel) + 64, dtype=torch.uint8)
        assert codec.view(raw, numel).numel() == numel
    assert state_bytes(which, numel) == sum(t.nbytes for t in packed)
    assert bytes_per_param(which) * numel == state_bytes(which, numel)


class _Blockwise8(StateCodec):
    """A stand-in for another blockwise format: one byte an element, an fp32 scale per 256."""
    name, storage_dtype, bytes_per_element, kernel_key = "toy8", torch.uint8, 1, "toy8"
    block, side_bytes_per_block = 256, 4


@pytest.mark.parametrize("numel,blocks,expected", [(0, None, 0), (1, None, 8), (128, None, 132), (129, None, 140),
                                                   (1000, None, 1032), (300, 5, 320), (3, 3, 16)])
def test_an_8_bit_moment_stores_codes_then_one_scale_per_block(numel, blocks, expected):
    codec = FP8_MOMENTS["exp_avg"]
    assert codec.stored_bytes(numel, blocks) == expected  # codes padded to 4 bytes, then the scales
    assert codec.bytes_per_param == 1 + 4 / 128
    region = torch.zeros(expected + 64, dtype=torch.uint8)
    q = codec.split(region, numel, blocks)
    assert q.codes.numel() == numel and q.scales.numel() == (blocks if blocks is not None else -(-numel // 128))
    assert codec.narrow(region, numel, blocks).numel() == expected


def test_registry_names_aliases_tags_and_refusals():
    for value, name in (("fp32", "fp32"), ("float32", "fp32"), (torch.float32, "fp32"), ("torch.float32", "fp32"),
                        ("bfloat16", "bf16"), (torch.bfloat16, "bf16"), ("half", "fp16"), (torch.float16, "fp16")):
        assert dtype_name(value) == name and codec_named(value).name == name
    for value in ("rem16", "int8"):  # rem16 is a stored form, not a dtype a user names
        with pytest.raises(UnsupportedStateDtype, match=r"is not supported \(fp32, fp16, bf16 or fp8\)$"):
            codec_named(value)
    for value in ("fp8", torch.uint8):  # megatron-core's name and its OptimizerConfig's dtype for it
        assert codec_named(value, "exp_avg") == FP8_MOMENTS["exp_avg"]
        assert codec_named(value, "exp_avg_sq") == FP8_MOMENTS["exp_avg_sq"]
    with pytest.raises(UnsupportedStateDtype, match="fp8 is for the Adam moments only, not the param"):
        codec_named("fp8", "param")
    assert codecs_for(["rem16", "bf16", "fp32"]) == (REMAINDERS16, BF16, FP32)
    assert codec_for_tag("fp8") is None and codec_for_tag(["fp32"]) is None
    with pytest.raises(UnsupportedStateDtype, match="unknown stored state format"):
        codecs_for(["fp32", "q8", "fp32"])
    assert [c.describe() for c in CODECS] == ["fp32", "bf16", "fp16", "rem16"]  # the tags saved files carry


def test_a_registered_format_is_known_by_its_tag_and_where_asked_by_its_name():
    try:
        register(_Blockwise8(), user_named=False)
        assert codec_for_tag("toy8") == _Blockwise8()
        with pytest.raises(UnsupportedStateDtype):
            codec_named("toy8")
        register(_Blockwise8(), user_named=True)
        assert codec_named("toy8") == _Blockwise8()
    finally:
        forget(_Blockwise8())
    assert codec_for_tag("toy8") is None  # forgotten: known neither by its tag nor by its name
    with pytest.raises(UnsupportedStateDtype):
        codec_named("toy8")


def test_a_codec_copied_between_processes_is_the_same_format():
    for codec in CODECS:
        copy = pickle.loads(pickle.dumps(codec))
        assert copy == codec and hash(copy) == hash(codec)
    assert BF16 != FP16 and FP32 != REMAINDERS16
    assert FP32.is_fp32 and not any(c.is_fp32 for c in (BF16, FP16, REMAINDERS16))


def test_the_one_pass_kernels_dispatch_on_the_codecs_and_leave_other_formats_to_the_multi_pass_path():
    from mlp_offload.kernels.cpu_one_pass import CpuOnePass, cpu_variants, verified_cpu_one_pass
    from mlp_offload.kernels.fused_update import one_pass_handles
    from mlp_offload.kernels.update import AdamKernel

    assert one_pass_handles((REMAINDERS16, BF16, FP16)) and one_pass_handles((FP16, FP32, BF16))
    assert not one_pass_handles((FP32, REMAINDERS16, FP32))  # a remainder is no moment
    unhandled = (FP32, _Blockwise8(), FP32)
    kernel, how = verified_cpu_one_pass(unhandled, AdamKernel("single"))
    assert kernel is None and how == "multi-pass (no one-pass kernel for fp32/toy8/fp32)"
    with pytest.raises(ValueError, match="no one-pass kernel for fp32/toy8/fp32"):
        CpuOnePass(cpu_variants()[0], unhandled, ext=object())
