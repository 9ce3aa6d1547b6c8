"""8-bit Adam moments in the engine (``--exp-avg-dtype fp8 --exp-avg-sq-dtype fp8``): over tier
mixes, the gpu tier, update sides, chunk sizes, read-ahead, relocations, param groups and params
cut anywhere by the shard, the engine's master params, codes and scales equal a plain numpy
reference (``test_blockwise8.ref_step``) bit for bit; subgroups end on block starts whatever
``subgroup_size`` is; bad combinations are refused in one line."""

import logging
import tempfile

import numpy as np
import pytest
import torch
from hypothesis import given, settings, strategies as st

from tests.profiles import examples

from mlp_offload import ModelLink, OffloadConfig, OffloadConfigError, OffloadedAdamW
from mlp_offload.kernels.fused_update import AdamHyper
from mlp_offload.state_formats import FP8_MOMENTS
from mlp_offload.subgroups.blocks import ShardParams

from mlp_offload.kernels.blockwise8 import BlockLayout
from mlp_offload.kernels.remainders import HostParamHigh, round_half_away
from mlp_offload.kernels.update import convert_grads

from .helpers import BETAS, EPS, LR, WD, ModelParams, device_config
from .strategies import device_setups
from .test_blockwise8 import F32, bits, ref_blocks, ref_step

FP8 = ("fp32", "fp8", "fp8")
CODECS = (FP8_MOMENTS["exp_avg"], FP8_MOMENTS["exp_avg_sq"])


@st.composite
def param_segments(draw, numel, group_ranges):
    """Params tiling the shard, each group range cut into params at random points; a param may
    start inside the param it belongs to (the shard's edge cut it)."""
    cuts = set()
    for a, b in group_ranges:
        cuts |= {a, b}
        cuts |= set(draw(st.sets(st.integers(a + 1, max(a + 1, b - 1)), max_size=3))) - {b} if b - a > 1 else set()
    bounds = sorted(cuts | {0, numel})
    return [(a, draw(st.sampled_from([0, 0, 1, 77, 300])), b - a) for a, b in zip(bounds, bounds[1:])]


def draw_case(case, seed, data):
    """(setup, its device options, relocations, param segments, init, generator) of a drawn
    ``device_setups`` case with 8-bit moments: the read-ahead sized for their state (the strategy sizes
    it for element-wise formats, 12 bytes an element; a short subgroup's 8-bit state takes more per
    element, its codes and scales padded to 4 bytes), params cut inside the param-group ranges."""
    setup, extra, relocate = case
    extra = {**extra, "device_read_ahead_bytes": 4 * extra["device_read_ahead_bytes"]}
    ranges = sorted(r for rs, _ in (setup.groups or [([(0, setup.numel)], {})]) for r in rs)
    segments = data.draw(param_segments(setup.numel, ranges))
    gen = torch.Generator().manual_seed(seed)
    return setup, extra, relocate, segments, torch.randn(setup.numel, generator=gen), gen


def engine_moments(eng):
    """(master, per moment: codes as uint8, each element's scale) of the whole shard."""
    masters, out = [], [([], []), ([], [])]
    params = eng.blocks.params
    for sg, p, m, v in eng.iter_state():
        masters.append(p.clone())
        layout = BlockLayout(params.clipped(sg.start, sg.end), CODECS[0].block)
        for k, (codec, t) in enumerate(zip(CODECS, (m, v))):
            q = codec.split(t, sg.numel, sg.blocks)
            out[k][0].append(q.codes.view(torch.uint8).clone())
            out[k][1].append(q.scales[layout.block_index("cpu")].clone())
    return torch.cat(masters), [(torch.cat(c), torch.cat(s)) for c, s in out]


class Reference:
    """The shard's state in numpy, stepped by ``ref_step`` group piece by group piece."""

    def __init__(self, init, segments, groups, numel):
        self.p = init.numpy().copy()
        self.blocks = ref_blocks(segments, CODECS[0].block)
        nb = int(self.blocks.max()) + 1
        self.m = (np.zeros(numel, np.uint8), np.zeros(nb, F32))
        self.v = (np.zeros(numel, np.uint8), np.zeros(nb, F32))
        self.pieces = [((a, b), {"lr": LR, "weight_decay": WD, **opts}) for ranges, opts in (groups or [([(0, numel)], {})])
                       for a, b in ranges]

    def step(self, grad, step):
        for (a, b), o in self.pieces:
            blocks = self.blocks[a:b]
            lo, hi = int(blocks.min()), int(blocks.max()) + 1
            local = blocks - lo
            p, m, v = ref_step(self.p[a:b], grad[a:b], (self.m[0][a:b], self.m[1][lo:hi]),
                               (self.v[0][a:b], self.v[1][lo:hi]), local, (CODECS[0].fmt, CODECS[1].fmt),
                               AdamHyper(o["lr"], BETAS[0], BETAS[1], EPS, o["weight_decay"]), step)
            self.p[a:b] = p
            for mine, new in ((self.m, m), (self.v, v)):
                mine[0][a:b], mine[1][lo:hi] = new

    def per_element(self, q):
        return q[0], q[1][self.blocks]


@settings(max_examples=examples(40), deadline=None, derandomize=True, print_blob=True)
@given(case=device_setups(), seed=st.integers(0, 3), remainders=st.booleans(), data=st.data())
def test_engine_with_8_bit_moments_matches_the_reference_bit_for_bit(case, seed, remainders, data):
    """With ``remainders`` the master is stored as int16 remainders beside the model's bf16 params (the
    default with --bf16): the reference then steps the merged fp32 master, which starts as the bf16 params."""
    setup, extra, relocate, segments, init, gen = draw_case(case, seed, data)
    numel = setup.numel
    model = None
    if remainders:  # a bf16 model: the master starts as its params
        init = init.to(torch.bfloat16).float()
        model = ModelParams(init.to(torch.bfloat16))
    ref = Reference(init, segments, setup.groups, numel)
    with tempfile.TemporaryDirectory() as root:
        cfg = device_config(setup, extra, root)
        cfg = OffloadConfig(**{**cfg.__dict__, "state_dtypes": FP8, "param_remainders": remainders})
        link = (ModelLink(param_segments=segments) if model is None else
                ModelLink(param_segments=segments, param_high=model.source, on_params_updated=model.on_params))
        with OffloadedAdamW(init.clone(), cfg, lr=LR, betas=BETAS, eps=EPS, weight_decay=WD, groups=setup.groups,
                            model=link) as eng:
            for sg in eng.subgroups[:-1]:  # every cut on a block start of its param
                assert ShardParams(segments, numel).is_block_start(sg.end, CODECS[0].block)
            for step in range(1, 4):
                grad = (torch.randn(numel, generator=gen) * 10).to(torch.bfloat16)
                eng.grad_buffer.copy_(grad)
                eng.step()
                ref.step(grad.float().numpy(), step)
                if relocate and step < 3:
                    eng.observe_device_memory(*relocate[step - 1])
            master, moments = engine_moments(eng)
    assert np.array_equal(bits(master), ref.p.view(np.uint32))
    if model is not None:  # the model holds the master rounded half away from zero
        assert torch.equal(model.params, round_half_away(torch.from_numpy(ref.p)))
    for (codes, scales), mine in zip(moments, (ref.m, ref.v)):
        ref_codes, ref_scales = ref.per_element(mine)
        assert np.array_equal(bits(codes), ref_codes)
        assert np.array_equal(bits(scales), ref_scales.view(np.uint32))


def test_state_bytes_count_codes_and_block_scales(caplog):
    numel, segments = 10_000, [(0, 0, 3000), (3000, 100, 2500), (5500, 0, 4500)]
    cfg = OffloadConfig(tiers=["host"], subgroup_size=1500, state_dtypes=FP8, pin_memory=False, run_id="t8",
                        adam_elems_per_s=1e9)
    with caplog.at_level(logging.INFO, logger="mlp_offload"):
        with OffloadedAdamW(torch.zeros(numel), cfg, model=ModelLink(param_segments=segments)) as eng:
            blocks = sum(sg.blocks for sg in eng.subgroups)
            assert blocks == len(np.unique(ref_blocks(segments, 128))) == 24 + 21 + 36
            for sg in eng.subgroups:
                assert sg.region_bytes(1) >= sg.numel + 4 * sg.blocks
    # the start-up line: 4 + 2 * (1 + 4/128) bytes a param, and the formats' tags
    assert any("state 6.1 B/param (fp32/e4m3-b128/sqrt-e4m3-b128)" in r.getMessage() for r in caplog.records)


@pytest.mark.parametrize("dtypes,message", [
    (("fp8", "fp32", "fp32"), "fp8 is for the Adam moments only"),
    (("fp32", "fp8", "bf16"), "both are fp8 or neither is"),
])
def test_bad_fp8_combinations_are_refused_in_one_line(dtypes, message):
    with pytest.raises(OffloadConfigError, match=message) as err:
        OffloadConfig(tiers=["host"], state_dtypes=dtypes)
    assert "\n" not in str(err.value)


def test_a_group_edge_inside_a_params_block_is_refused():
    cfg = OffloadConfig(tiers=["host"], state_dtypes=FP8, pin_memory=False, run_id="t8e", adam_elems_per_s=1e9)
    with pytest.raises(ValueError, match="inside a param's block of 128"):
        OffloadedAdamW(torch.zeros(1000), cfg, groups=[([(0, 500)], {}), ([(500, 1000)], {})],
                       model=ModelLink(param_segments=[(0, 0, 1000)]))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the device's 8-bit update needs a CUDA device")
@pytest.mark.parametrize("update_on", ["device", "cpu", "auto"])
@pytest.mark.parametrize("read_ahead", [0, 3])
def test_cuda_engine_with_8_bit_moments_matches_the_reference(tmp_path, update_on, read_ahead):
    """On the GPU: subgroups in HBM (updated in place), in host memory and on disk (streamed through the
    device or updated by the CPU); the Triton kernel, its CPU twin and the reference agree bit for bit."""
    numel, sub = 120_000, 9_000
    segments = [(0, 0, 30_000), (30_000, 500, 41_000), (71_000, 0, 49_000)]
    groups = [([(0, 30_000), (71_000, 120_000)], {}), ([(30_000, 71_000)], {"weight_decay": 0.0, "lr": 3e-3})]
    gen = torch.Generator().manual_seed(5)
    init = torch.randn(numel, generator=gen)
    ref = Reference(init, segments, groups, numel)
    slot = 6 * sub + 4096 * 3
    (tmp_path / "nvme").mkdir()
    cfg = OffloadConfig(tiers=["gpu", "host", "nvme"], paths={"nvme": str(tmp_path / "nvme")}, device="cuda",
                        subgroup_size=sub, state_dtypes=FP8, gpu_budget_bytes=4 * slot, host_budget_bytes=6 * slot,
                        update_on=update_on, device_read_ahead_bytes=read_ahead * slot, run_id="cuda8",
                        bandwidths={"nvme": (2e9, 1e9)}, adam_elems_per_s=1e9, device_adam_elems_per_s=4e9,
                        device_streamed_elems_per_s=2e9)
    with OffloadedAdamW(init.clone(), cfg, lr=LR, betas=BETAS, eps=EPS, weight_decay=WD, groups=groups,
                        model=ModelLink(param_segments=segments)) as eng:
        assert {"gpu", "host", "nvme"} <= set(eng.placement.tier_of)
        for step in range(1, 4):
            grad = (torch.randn(numel, generator=gen) * 10).to(torch.bfloat16)
            eng.grad_buffer.copy_(grad)
            eng.step()
            ref.step(grad.float().numpy(), step)
        master, moments = engine_moments(eng)
    assert np.array_equal(bits(master.cpu()), ref.p.view(np.uint32))
    for (codes, scales), mine in zip(moments, (ref.m, ref.v)):
        ref_codes, ref_scales = ref.per_element(mine)
        assert np.array_equal(bits(codes.cpu()), ref_codes)
        assert np.array_equal(bits(scales.cpu()), ref_scales.view(np.uint32))


class DeviceGrads:
    """The model's grads in one tensor on the update's device, as the Megatron adapter's source gives them:
    converted into the update's buffer, or read where they lie (``views``)."""

    def __init__(self, grads: torch.Tensor):
        self.grads = grads

    def start(self, start, end, out, unscale, clip_coef):
        convert_grads(self.grads[start:end], out, unscale, clip_coef)

    def wait(self, start):
        pass

    def to_device(self, start, end, out, unscale, clip_coef):
        convert_grads(self.grads[start:end], out, unscale, clip_coef)

    def views(self, start, end):
        yield start, end, self.grads[start:end]


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(
    not torch.cuda.is_available(), reason="the Triton kernel needs a CUDA device"))])
@pytest.mark.parametrize("remainders", [False, True])
def test_an_engine_on_the_model_buffers_matches_the_reference(device, remainders):
    """The device's 8-bit update on the model's own grads and params (gpu and host tiers, the in-HBM subgroups
    interleaved with the streamed ones): the master, codes and scales equal the numpy reference bit for bit, and
    the model's params are the master rounded (half away from zero with remainders, else to nearest even)."""
    numel, sub = 120_000, 9_000
    segments = [(0, 0, 30_000), (30_000, 500, 41_000), (71_000, 0, 49_000)]
    groups = [([(0, 30_000), (71_000, 120_000)], {}), ([(30_000, 71_000)], {"weight_decay": 0.0, "lr": 3e-3})]
    gen = torch.Generator().manual_seed(11)
    init = torch.randn(numel, generator=gen)
    if remainders:  # a bf16 model: the master starts as its params
        init = init.to(torch.bfloat16).float()
    params = init.to(torch.bfloat16).to(device)
    grads = torch.zeros(numel, dtype=torch.bfloat16, device=device)
    ref = Reference(init, segments, groups, numel)
    slot = 6 * sub + 4096 * 3
    cfg = OffloadConfig(tiers=["gpu", "host"], device=device, subgroup_size=sub, state_dtypes=FP8,
                        gpu_budget_bytes=5 * slot, host_budget_bytes=16 * slot, update_on="device",
                        param_remainders=remainders, run_id="model8", adam_elems_per_s=1e9,
                        device_adam_elems_per_s=4e9, device_streamed_elems_per_s=2e9)
    handed = []  # subgroups whose params came back as a copy: none, on the model's buffers

    def on_params(start, end, p):
        handed.append(start)
        params[start:end].copy_(p)

    link = ModelLink(param_segments=segments, grad_source=DeviceGrads(grads), param_high=HostParamHigh(params),
                     on_params_updated=on_params)
    with OffloadedAdamW(init.clone(), cfg, lr=LR, betas=BETAS, eps=EPS, weight_decay=WD, groups=groups,
                        model=link) as eng:
        assert eng.update_paths.on_model_buffers, eng.update_paths.device_update.fused_how
        assert {"gpu", "host"} <= set(eng.placement.tier_of)
        for step in range(1, 4):
            grad = (torch.randn(numel, generator=gen) * 10).to(torch.bfloat16)
            grads.copy_(grad)
            eng.step()
            ref.step(grad.float().numpy(), step)
        assert handed == []
        master, moments = engine_moments(eng)
    assert np.array_equal(bits(master.cpu()), ref.p.view(np.uint32))
    want = torch.from_numpy(ref.p)
    want = round_half_away(want) if remainders else want.to(torch.bfloat16)
    assert torch.equal(params.cpu().view(torch.int16), want.view(torch.int16))
    for (codes, scales), mine in zip(moments, (ref.m, ref.v)):
        ref_codes, ref_scales = ref.per_element(mine)
        assert np.array_equal(bits(codes.cpu()), ref_codes)
        assert np.array_equal(bits(scales.cpu()), ref_scales.view(np.uint32))
