"""Checkpoints of 8-bit Adam moments: saved (synchronously or in the background, from any tier mix,
the gpu tier's CPU twin included) and loaded at the same shard, a run continues bit for bit as the
numpy reference of an uninterrupted one, whatever the loading engine's tiers and subgroup size; the
file's regions are its codes and scales byte for byte; a reader gives any range as values and a
block-aligned one as codes and scales; a footer that misstates blocks is refused; a load across
moment formats dequantizes or quantizes once and says so in one line, and a file of other param segments
loads requantized under the engine's blocks."""

import dataclasses
import json
import os
import logging
import tempfile
import zlib
from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import given, settings, strategies as st

from tests.profiles import examples

from mlp_offload import ModelLink, OffloadConfig, OffloadedAdamW
from mlp_offload.checkpoint import (MAGIC, TRAILER, CheckpointDataError, StateFile, load_engine_state, read_footer,
                                    subgroups_file_bytes)
from mlp_offload.checkpoint.write import save_engine_state, start_background_save
from mlp_offload.kernels.blockwise8 import Quantized

from .helpers import BETAS, EPS, LR, WD, device_config, engine_state, fast_config
from .strategies import device_setups
from .test_blockwise8 import bits, ref_blocks, ref_dequantize, ref_quantize
from .test_eight_bit_engine import CODECS, FP8, Reference, draw_case, engine_moments

FP32_MOMENTS = ("fp32", "fp32", "fp32")


def fp8_engine(init, cfg, segments, groups=None):
    return OffloadedAdamW(init.clone(), OffloadConfig(**{**cfg.__dict__, "state_dtypes": FP8}), lr=LR, betas=BETAS,
                          eps=EPS, weight_decay=WD, groups=groups, model=ModelLink(param_segments=segments))


def assert_like_reference(eng, ref):
    master, moments = engine_moments(eng)
    assert np.array_equal(bits(master), ref.p.view(np.uint32))
    for (codes, scales), mine in zip(moments, (ref.m, ref.v)):
        ref_codes, ref_scales = ref.per_element(mine)
        assert np.array_equal(bits(codes), ref_codes)
        assert np.array_equal(bits(scales), ref_scales.view(np.uint32))


@settings(max_examples=examples(25), deadline=None, derandomize=True, print_blob=True)
@given(case=device_setups(), seed=st.integers(0, 3), background=st.booleans(),
       load_subgroup=st.integers(200, 30_000), load_tiers=st.sampled_from([["host"], ["nvme"], ["host", "nvme"]]),
       data=st.data())
def test_saved_and_loaded_at_the_same_shard_continues_bit_for_bit(case, seed, background, load_subgroup,
                                                                  load_tiers, data):
    setup, extra, _, segments, init, gen = draw_case(case, seed, data)
    numel = setup.numel
    grads = [(torch.randn(numel, generator=gen) * 10).to(torch.bfloat16) for _ in range(4)]
    ref = Reference(init, segments, setup.groups, numel)
    with tempfile.TemporaryDirectory() as root:
        path = f"{root}/state.offload"
        cfg = device_config(setup, extra, root)
        if cfg.host_budget_bytes:  # sized for fp32 subgroups; 8-bit ones end up to a block later
            cfg = dataclasses.replace(cfg, host_budget_bytes=2 * cfg.host_budget_bytes)
        with fp8_engine(init, cfg, segments, setup.groups) as eng:
            for step, grad in enumerate(grads[:2], 1):
                eng.grad_buffer.copy_(grad)
                eng.step()
                ref.step(grad.float().numpy(), step)
            saved_master, saved_moments = engine_moments(eng)
            if background:
                write = start_background_save(eng, path, metadata={"iteration": 2})
                write.start()
                eng.grad_buffer.copy_(grads[2])
                eng.step()  # changes nothing the writer has
                write.wait()
                assert write.failure is None
            else:
                save_engine_state(eng, path, metadata={"iteration": 2})
            expected_bytes = subgroups_file_bytes(eng.subgroups)
        with StateFile(path) as saved:  # the regions hold the codes and scales as they were, byte for byte
            footer_bytes = len(json.dumps(saved.footer).encode())
            assert os.path.getsize(path) == expected_bytes + footer_bytes + TRAILER.size
            reader = saved.ranges()
            for k, (codes, scales) in enumerate(saved_moments, 1):
                whole = Quantized(torch.empty(numel, dtype=CODECS[k - 1].fmt.dtype),
                                  torch.empty(sum(e["blocks"] for e in saved.footer["subgroups"])), CODECS[k - 1].fmt)
                reader.read_quantized(k, 0, numel, whole)
                assert torch.equal(whole.codes.view(torch.uint8), codes)
                assert torch.equal(whole.scales[torch.from_numpy(ref_blocks(segments, 128))], scales)
        load_cfg = fast_config(Path(root) / "load", tiers=load_tiers, subgroup_size=load_subgroup,
                               pin_memory=False)
        with fp8_engine(torch.zeros(numel), load_cfg, segments, setup.groups) as loaded:
            assert load_engine_state(loaded, path) == {"iteration": 2}
            assert loaded.steps_done == 2
            master, moments = engine_moments(loaded)
            assert torch.equal(master, saved_master)
            for got, want in zip(moments, saved_moments):
                assert all(torch.equal(a, b) for a, b in zip(got, want))
            for step, grad in enumerate(grads[2:], 3):
                loaded.grad_buffer.copy_(grad)
                loaded.step()
                ref.step(grad.float().numpy(), step)
            assert_like_reference(loaded, ref)


SEGMENTS = [(0, 0, 3000), (3000, 100, 2500), (5500, 0, 4500), (10_000, 64, 700)]
NUMEL = 10_700


def _saved_fp8(tmp_path, steps=2):
    init = torch.randn(NUMEL, generator=torch.Generator().manual_seed(5))
    grads = [(torch.randn(NUMEL, generator=torch.Generator().manual_seed(6 + s)) * 10).to(torch.bfloat16)
             for s in range(steps)]
    with fp8_engine(init, fast_config(tmp_path / "a", tiers=["nvme"], subgroup_size=1500), SEGMENTS) as eng:
        for g in grads:
            eng.grad_buffer.copy_(g)
            eng.step()
        master, moments = engine_moments(eng)
        path = str(tmp_path / "fp8.offload")
        save_engine_state(eng, path)
    return path, master, moments


def _values(moments):
    """The fp32 moments the codes and scales of ``engine_moments`` stand for (numpy, as the reference decodes)."""
    blocks = np.arange(NUMEL)
    return [ref_dequantize(codes.numpy(), scales.numpy(), blocks, codec.fmt)
            for (codes, scales), codec in zip(moments, CODECS)]


@settings(max_examples=examples(30), deadline=None, derandomize=True)
@given(data=st.data(), bounded=st.booleans())
def test_a_reader_gives_any_range_as_values_and_block_aligned_ones_as_stored(tmp_path_factory, data, bounded):
    tmp = tmp_path_factory.mktemp("reader")
    path, _, moments = _saved_fp8(tmp)
    values = _values(moments)
    blocks = ref_blocks(SEGMENTS, 128)
    starts = [0] + [i for i in range(1, NUMEL) if blocks[i] != blocks[i - 1]] + [NUMEL]
    with StateFile(path) as saved:
        reader = saved.ranges(cache_bytes=3_000 if bounded else None)  # bounded: no region is cached
        a = data.draw(st.integers(0, NUMEL - 1))
        b = data.draw(st.integers(a + 1, NUMEL))
        for k in (1, 2):
            out = torch.empty(b - a, dtype=torch.float32)
            reader.read(k, a, b, out)
            assert np.array_equal(bits(out), values[k - 1][a:b].view(np.uint32))
        a, b = sorted(data.draw(st.lists(st.sampled_from(starts), min_size=2, max_size=2, unique=True)))
        n_blocks = len(np.unique(blocks[a:b]))
        for k, (codes, scales) in enumerate(moments, 1):
            got = Quantized(torch.empty(b - a, dtype=CODECS[k - 1].fmt.dtype), torch.empty(n_blocks), CODECS[k - 1].fmt)
            reader.read_quantized(k, a, b, got)
            assert torch.equal(got.codes.view(torch.uint8), codes[a:b])
            assert torch.equal(got.scales[torch.from_numpy(blocks[a:b] - blocks[a])], scales[a:b])
        inside = data.draw(st.sampled_from(sorted(set(range(1, NUMEL)) - set(starts))))
        with pytest.raises(CheckpointDataError, match=f"element {inside} is inside a block"):
            reader.read_quantized(1, inside, NUMEL, got)
        assert not reader.is_block_boundary(inside) and reader.is_block_boundary(starts[1])
        assert (reader.cached_elements == []) == bounded


def assert_quantized_from(moments, values, segments):
    """``moments`` (``engine_moments``' codes and scales) are ``values`` quantized under the blocks of ``segments``."""
    blocks = ref_blocks(segments, 128)
    for (codes, scales), value, codec in zip(moments, values, CODECS):
        stored = np.sqrt(value.astype(np.float64)).astype(np.float32) if codec.fmt.root else value
        want_codes, want_scales = ref_quantize(stored, blocks, codec.fmt)
        assert np.array_equal(bits(codes), want_codes)
        assert np.array_equal(bits(scales), want_scales[blocks].view(np.uint32))


def _resigned(path, edit):
    data = open(path, "rb").read()
    _, length, _ = TRAILER.unpack(data[-TRAILER.size:])
    body, footer = data[: len(data) - TRAILER.size - length], json.loads(data[len(data) - TRAILER.size - length:
                                                                              -TRAILER.size])
    edit(footer)
    new = json.dumps(footer).encode()
    with open(path, "wb") as f:
        f.write(body + new + TRAILER.pack(MAGIC, len(new), zlib.crc32(new)))


@pytest.mark.parametrize("edit,why", [
    (lambda f: f["subgroups"][0].update(blocks=f["subgroups"][0]["blocks"] + 1), "records 13 blocks, its param "
                                                                                 "segments make 12"),
    (lambda f: f.pop("blocks"), "8-bit moments"),
    (lambda f: f["blocks"]["param_segments"].__setitem__(1, [3000, 0, 2500]), "does not start and end on block starts"),
    (lambda f: f["blocks"].update(param_segments=[[0, 0, 20_000]]), "segments must lie in the shard"),
])
def test_a_footer_that_misstates_the_blocks_is_refused(tmp_path, edit, why):
    path, _, _ = _saved_fp8(tmp_path, steps=1)
    _resigned(path, edit)
    with pytest.raises(CheckpointDataError, match=f"footer is inconsistent.*{why}"):
        read_footer(path)


def test_fp8_moments_load_into_fp32_ones_dequantized_and_back_quantized_with_one_notice(tmp_path, caplog):
    path, master, moments = _saved_fp8(tmp_path)
    values = _values(moments)
    plain_cfg = fast_config(tmp_path / "b", tiers=["host"], subgroup_size=4000, state_dtypes=FP32_MOMENTS)
    with caplog.at_level(logging.WARNING, logger="mlp_offload"):
        with OffloadedAdamW(torch.zeros(NUMEL), plain_cfg) as plain:
            load_engine_state(plain, path)
            _, m, v = engine_state(plain)
            assert np.array_equal(bits(m), values[0].view(np.uint32))
            assert np.array_equal(bits(v), values[1].view(np.uint32))
            save_engine_state(plain, str(tmp_path / "fp32.offload"))
    notices = [r.getMessage() for r in caplog.records if "Adam moments are stored as" in r.getMessage()]
    assert len(notices) == 1 and "\n" not in notices[0] and "dequantized" in notices[0]
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="mlp_offload"):
        with fp8_engine(torch.zeros(NUMEL), fast_config(tmp_path / "c", tiers=["nvme"], subgroup_size=2000),
                        SEGMENTS) as back:
            load_engine_state(back, str(tmp_path / "fp32.offload"))
            got_master, got = engine_moments(back)
    assert torch.equal(got_master, master)
    assert_quantized_from(got, values, SEGMENTS)
    assert any("quantized as they load" in r.getMessage() for r in caplog.records)


def test_fp8_moments_saved_under_other_param_segments_load_requantized_under_the_engines(tmp_path):
    """A file whose param segments differ from the engine's (same size): its blocks are not the
    engine's, so the moments load as values, quantized under the engine's blocks."""
    path, master, moments = _saved_fp8(tmp_path)
    values = _values(moments)
    other = [(0, 0, 5000), (5000, 0, NUMEL - 5000)]
    with fp8_engine(torch.zeros(NUMEL), fast_config(tmp_path / "o", tiers=["host"], subgroup_size=3000), other) as eng:
        load_engine_state(eng, path)
        got_master, got = engine_moments(eng)
    assert torch.equal(got_master, master)
    assert_quantized_from(got, values, other)
