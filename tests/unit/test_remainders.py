"""Lossless 16-bit master remainders (megatron-core's store_param_remainders): the split and merge
against a bit-level reference written here; the engine over tier mixes, budgets, update sides (CPU
and the device update's CPU twin), param groups and moment dtypes against torch.optim.AdamW on an
fp32 master whose bf16 model param is rounded half away after each step; checkpoints in the stored
form, crossing to and from engines without remainders; the bytes per param."""

import dataclasses
import logging
import os
import struct
import tempfile

import pytest
import torch
from hypothesis import given, settings, strategies as st

from tests.profiles import examples

from mlp_offload import ModelLink
from mlp_offload import ModelParamsAsMaster, OffloadConfig, OffloadConfigError, OffloadedAdamW
from mlp_offload.checkpoint import CheckpointDataError, RangeReader, load_engine_state, read_footer, stored_codecs
from mlp_offload.checkpoint.write import save_engine_state
from mlp_offload.kernels.remainders import merge, round_half_away, split

from .helpers import BETAS, EPS, LR, WD, ModelParams, adamw_reference, device_config, engine_state
from .strategies import device_setups

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def _ref_split(u: int):
    """One fp32 bit pattern (unsigned) -> (remainder, bf16 bits), as transformer-engine's adam.cu
    does it: low half as int16; high half plus one where that is negative."""
    low, high = u & 0xFFFF, u >> 16
    rem = low - 0x10000 if low >= 0x8000 else low
    return rem, (high + (rem < 0)) & 0xFFFF


SPECIAL = [0, 0x80000000, 1, 0x80000001, 0x7F7FFFFF, 0xFF7FFFFF, 0x7F7F7FFF, 0x7F7F8000, 0x007FFFFF,
           0x807FFFFF, 0x00008000, 0x80008000, 0x3F808000, 0x3F818000, 0xBF808000, 0x7F800000, 0xFF800000]


@settings(max_examples=examples(200), deadline=None)
@given(bits=st.lists(st.one_of(st.integers(0, 2**32 - 1), st.sampled_from(SPECIAL)), min_size=1, max_size=300))
def test_split_and_merge_match_the_bit_reference_and_round_trip(bits):
    master = torch.tensor([b - 2**32 if b >= 2**31 else b for b in bits], dtype=torch.int32).view(torch.float32)
    rem, high = split(master)
    for u, r, h in zip(bits, rem.tolist(), high.view(torch.int16).tolist()):
        ref_rem, ref_high = _ref_split(u)
        assert r == ref_rem and h & 0xFFFF == ref_high, hex(u)
    assert torch.equal(merge(high, rem).view(torch.int32), master.view(torch.int32))
    # Against torch's round-to-nearest-even: equal except on exact ties of finite values.
    finite = torch.isfinite(master)
    tie = (master.view(torch.int32) & 0xFFFF) == 0x8000
    rne = master.to(torch.bfloat16).view(torch.int16)
    same = high.view(torch.int16) == rne
    assert bool(same[finite & ~tie].all())


def test_split_of_bf16_values_is_the_value_with_zero_remainders():
    values = torch.randn(1000).to(torch.bfloat16)
    rem, high = split(values.float())
    assert not rem.any() and torch.equal(high.view(torch.int16), values.view(torch.int16))
    assert struct.unpack("<f", struct.pack("<I", 0x3F808000))[0] == 1.00390625  # a tie: RNE down, here up
    assert round_half_away(torch.tensor([1.00390625])).item() == 1.0078125


def _ref_step(pieces, opt, grad, moment_dtypes):
    """The fp32 master's AdamW step; moments rounded to their stored dtypes (the master is exact)."""
    for (a, b), p in pieces:
        p.grad = grad.float()[a:b].clone()
    opt.step()
    with torch.no_grad():
        for _, p in pieces:
            for name, dtype in zip(("exp_avg", "exp_avg_sq"), moment_dtypes):
                opt.state[p][name].copy_(opt.state[p][name].to(dtype).float())


def _whole(pieces, numel, value):
    out = torch.empty(numel)
    for (a, b), p in pieces:
        out[a:b] = value(p)
    return out


def _engine(init_bf16, cfg, model, groups=None, fills=None):
    """``fills``: a list: the initial params then come as the model's own (``ModelParamsAsMaster``,
    as the Megatron layer gives them), each call of the fill function appended to it."""
    params = init_bf16.clone()
    if fills is not None:
        params = ModelParamsAsMaster(lambda start, end, out: (fills.append((start, end)),
                                                              out.copy_(init_bf16[start:end])))
    return OffloadedAdamW(params, cfg, lr=LR, betas=BETAS, eps=EPS, weight_decay=WD, groups=groups,
                          numel=init_bf16.numel(),
                          model=ModelLink(on_params_updated=model.on_params, param_high=model.source))


@settings(max_examples=examples(60), deadline=None, derandomize=True, print_blob=True)
@given(case=device_setups(), moments=st.tuples(st.sampled_from(["fp32", "bf16"]), st.sampled_from(["fp32", "bf16"])),
       seed=st.integers(0, 3), from_model=st.booleans())
def test_engine_with_remainders_matches_fp32_master_adamw_bit_for_bit(case, moments, seed, from_model):
    """``from_model``: the initial masters said to be the model's params (zero remainders, never filled)."""
    setup, extra, relocate = case
    gen = torch.Generator().manual_seed(seed)
    init = torch.randn(setup.numel, generator=gen).to(torch.bfloat16)  # the model's params
    moment_dtypes = [DTYPES[m] for m in moments]
    kernel = setup.options["adam_kernel"]
    pieces, opt = adamw_reference(setup, init.float(), kernel)
    model = ModelParams(init.clone())
    with tempfile.TemporaryDirectory() as root:
        cfg = dataclasses.replace(device_config(setup, extra, root), param_remainders=True,
                                  state_dtypes=("fp32", *moments))
        fills = [] if from_model else None
        with _engine(init, cfg, model, setup.groups, fills) as eng:
            assert not fills  # zeros by construction: the model's params are never read for them
            for step in range(3):
                grad = (torch.randn(setup.numel, generator=gen) * 10).to(torch.bfloat16)
                eng.grad_buffer.copy_(grad)
                model.handed = 0
                eng.step()
                _ref_step(pieces, opt, grad, moment_dtypes)
                assert model.handed == setup.numel and model.dtypes == {torch.bfloat16}
                master = _whole(pieces, setup.numel, lambda p: p.detach())
                assert torch.equal(model.params.view(torch.int16), round_half_away(master).view(torch.int16))
                if relocate and step < 2:
                    eng.observe_device_memory(*relocate[step])
            params, exp_avg, exp_avg_sq = engine_state(eng)
            assert params.dtype == torch.float32
            assert torch.equal(params.view(torch.int32), master.view(torch.int32))
            for got, name in ((exp_avg, "exp_avg"), (exp_avg_sq, "exp_avg_sq")):
                assert torch.equal(got.float(), _whole(pieces, setup.numel, lambda p: opt.state[p][name]))
            assert all(sg.codecs[0].stored_bytes(sg.numel) == 2 * sg.numel for sg in eng.subgroups)


def _plain_config(tmp_path, tiers, name, **overrides):
    paths = {"nvme": str(tmp_path / name)} if "nvme" in tiers else {}
    (tmp_path / name).mkdir(exist_ok=True)
    options = dict(tiers=tiers, paths=paths, subgroup_size=7_000, run_id=name, pin_memory=False,
                   host_budget_bytes=3 * 7_000 * 12 if "nvme" in tiers and "host" in tiers else None,
                   adam_elems_per_s=1e9, bandwidths={"nvme": (2e9, 1e9)} if "nvme" in tiers else {})
    options.update(overrides)
    return OffloadConfig(**options)


@pytest.mark.parametrize("save_rem,load_rem,load_tiers", [
    (True, True, ["host", "nvme"]), (True, False, ["nvme"]), (False, True, ["host"]), (True, True, ["gpu", "host"])])
def test_checkpoints_cross_remainders_on_and_off_and_continue_bit_identically(tmp_path, save_rem, load_rem,
                                                                              load_tiers):
    """Saved after 2 steps, loaded into another engine (remainders on or off, other tiers), 3 more
    steps: the master and the model's params equal an uninterrupted fp32-master run's."""
    numel = 50_001
    gen = torch.Generator().manual_seed(2)
    init = torch.randn(numel, generator=gen).to(torch.bfloat16)
    grads = [(torch.randn(numel, generator=gen) * 10).to(torch.bfloat16) for _ in range(5)]
    pieces, opt = adamw_reference(_Whole(numel), init.float(), "fused")
    for grad in grads:
        _ref_step(pieces, opt, grad, [torch.float32] * 2)
    expected = pieces[0][1].detach()

    model = ModelParams(init.clone())
    cfg = _plain_config(tmp_path, ["nvme"], "save", param_remainders=save_rem)
    path = str(tmp_path / "state.bin")
    with _engine(init, cfg, model) as eng:
        for grad in grads[:2]:
            eng.grad_buffer.copy_(grad)
            eng.step()
        save_engine_state(eng, path)
    assert read_footer(path)["dtypes"][0] == ("rem16" if save_rem else "fp32")
    saved_model = model.params.clone()  # the model checkpoint of the same step

    model = ModelParams(saved_model.clone())
    extra = dict(gpu_budget_bytes=10**9) if "gpu" in load_tiers else {}
    cfg = _plain_config(tmp_path, load_tiers, "load", param_remainders=load_rem, **extra)
    with _engine(torch.zeros(numel, dtype=torch.bfloat16), cfg, model) as eng:
        load_engine_state(eng, path)
        for grad in grads[2:]:
            eng.grad_buffer.copy_(grad)
            eng.step()
        master = engine_state(eng)[0]
    assert torch.equal(master.view(torch.int32), expected.view(torch.int32))
    if load_rem:
        assert torch.equal(model.params.view(torch.int16), round_half_away(expected).view(torch.int16))


class _Whole:
    def __init__(self, numel):
        self.numel, self.groups = numel, None


def test_a_remainders_file_is_not_read_as_numbers(tmp_path):
    """Readers that cannot merge (e.g. resharding ones) get an error, never the int16 as values."""
    numel = 1000
    model = ModelParams(torch.randn(numel).to(torch.bfloat16))
    path = str(tmp_path / "state.bin")
    with _engine(model.params, _plain_config(tmp_path, ["host"], "a", param_remainders=True), model) as eng:
        save_engine_state(eng, path)
    footer = read_footer(path)
    with RangeReader(path, footer["subgroups"], stored_codecs(footer)) as reader:
        with pytest.raises(CheckpointDataError, match="16-bit remainders"):
            reader.read(0, 0, numel, torch.empty(numel))
    with OffloadedAdamW(torch.zeros(numel), _plain_config(tmp_path, ["host"], "b")) as eng:
        with pytest.raises(CheckpointDataError, match="no param_high"):
            load_engine_state(eng, path)


@pytest.mark.parametrize("moments,expected", [(("fp32", "fp32"), "10.0 B/param (rem16/fp32/fp32)"),
                                              (("bf16", "bf16"), "6.0 B/param (rem16/bf16/bf16)")])
def test_bytes_per_param_in_tiers_and_the_start_up_line(tmp_path, caplog, moments, expected):
    numel = 40_000
    model = ModelParams(torch.randn(numel).to(torch.bfloat16))
    cfg = _plain_config(tmp_path, ["nvme"], "n", param_remainders=True, state_dtypes=("fp32", *moments),
                        subgroup_size=numel)
    with caplog.at_level(logging.INFO, logger="mlp_offload"):
        with _engine(model.params, cfg, model) as eng:
            per_param = sum(eng.subgroups[0].region_bytes(k) for k in range(3)) / numel
            # abs=0.5: each region is padded to the storage alignment, the start-up line rounds to 0.1
            assert per_param == pytest.approx(float(expected.split()[0]), abs=0.5)
            path = str(tmp_path / "state.bin")
            save_engine_state(eng, path)
    assert any(expected in r.getMessage() for r in caplog.records)
    assert os.path.getsize(path) - numel * float(expected.split()[0]) < 64 * 1024


def test_bad_remainder_settings_name_the_field(tmp_path):
    with pytest.raises(OffloadConfigError, match=r"param_remainders.*state_dtypes\[0\]\) is bf16"):
        OffloadConfig(tiers=["host"], state_dtypes=("bf16", "fp32", "fp32"), param_remainders=True)
    with pytest.raises(OffloadConfigError, match="param_remainders"):
        OffloadConfig(tiers=["host"], param_remainders=1)
    with pytest.raises(OffloadConfigError, match="param_high"):
        OffloadedAdamW(torch.zeros(10), OffloadConfig(tiers=["host"], param_remainders=True, pin_memory=False,
                                                      adam_elems_per_s=1e9))


def test_a_background_save_while_stepping_writes_what_a_synchronous_save_does(tmp_path, monkeypatch):
    """The stored form (int16 remainders) through the snapshot: staged copies and linked files."""
    from mlp_offload import faults
    from mlp_offload.checkpoint.write import start_background_save

    numel = 70_001
    gen = torch.Generator().manual_seed(5)
    model = ModelParams(torch.randn(numel, generator=gen).to(torch.bfloat16))
    grads = [torch.randn(numel, generator=gen).to(torch.bfloat16) for _ in range(5)]
    cfg = _plain_config(tmp_path, ["host", "nvme"], "bg", param_remainders=True, subgroup_size=10_000,
                        host_budget_bytes=4 * 2 * 40960)
    with _engine(model.params, cfg, model) as eng:
        for grad in grads[:3]:
            eng.grad_buffer.copy_(grad)
            eng.step()
        save_engine_state(eng, str(tmp_path / "sync.ckpt"))
        monkeypatch.setattr(faults, "_delays", "save-offload=0.05")
        write = start_background_save(eng, str(tmp_path / "async.ckpt"))
        assert write.snapshot.memory and write.snapshot.on_tier
        write.start()
        for grad in grads[3:]:
            eng.grad_buffer.copy_(grad)
            eng.step()
        assert not write.done()  # the steps went on (staged copies) while the writer was at work
        write.wait()
        assert write.failure is None
    assert (tmp_path / "async.ckpt").read_bytes() == (tmp_path / "sync.ckpt").read_bytes()
