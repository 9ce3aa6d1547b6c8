"""The device update's one-pass kernel (mlp_offload.kernels.fused_update).

On the CPU (CI) the Triton kernel cannot run: its stand-in (the multi-pass arithmetic behind the
one-pass interface) drives the engine's one-pass slicing (chunks, param-group pieces, remainders'
high halves), which must give the multi-pass engine's bits; and the start-up check must reject a
kernel one ulp off. On a CUDA machine the kernel itself is checked against the multi-pass path and
torch.optim.AdamW over every stored-dtype combination."""

import dataclasses
import tempfile

import pytest
import torch
from hypothesis import given, settings, strategies as st

from mlp_offload import ModelLink, OffloadedAdamW
from mlp_offload.step import update_paths as paths_module
from mlp_offload.kernels.fused_update import (PLAIN, SAMPLE_HYPERS, VARIANTS, AdamHyper, ReferenceOnePass, matches, multi_pass_step,
                                      sample_state, verified_fused_update)
from mlp_offload.kernels.update import AdamKernel
from mlp_offload.state_formats import FP32, codecs_for

from .helpers import BETAS, EPS, LR, WD, ModelParams, device_config, engine_state
from .strategies import device_setups
from tests.profiles import examples

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def _run(setup, extra, moments, remainders, one_pass, seed, root, on_model=True):
    cfg = dataclasses.replace(device_config(setup, extra, root), param_remainders=remainders,
                              state_dtypes=("fp32", *moments), device_model_buffers=on_model)
    state, model, _ = _run_config(setup, cfg, remainders, one_pass, seed)
    return state, model


def _run_config(setup, cfg, remainders, one_pass, seed=0):
    """Three steps of an engine (the one-pass stand-in or not): its state, the model's params and
    whether the one-pass path was taken."""
    gen = torch.Generator().manual_seed(seed)
    init = torch.randn(setup.numel, generator=gen).to(torch.bfloat16 if remainders else torch.float32)
    model = ModelParams(init.clone())
    kwargs = dict(model=ModelLink(on_params_updated=model.on_params, param_high=model.source)) if remainders else {}
    used = []
    real = paths_module.verified_fused_update

    def stand_in(device, dtypes, kernel):
        if kernel.kind == "fused":  # as on CUDA: torch's fused kernel keeps the multi-pass path
            return None, "multi-pass"
        used.append(True)
        return ReferenceOnePass(kernel, dtypes), "one pass (CPU stand-in)"
    paths_module.verified_fused_update = stand_in if one_pass else real
    try:
        with OffloadedAdamW(init.clone(), cfg, lr=LR, betas=BETAS, eps=EPS, weight_decay=WD, groups=setup.groups,
                            **kwargs) as eng:
            if one_pass and eng.update_paths.device_update is not None and eng.device_adam.kind != "fused":
                assert used and eng.update_paths.device_update.fused is not None
                # the model's buffers where the model is given (remainders) and the config lets it
                assert eng.update_paths.device_update.on_model_buffers == (remainders and cfg.device_model_buffers)
            for k in range(3):
                eng.grad_buffer.copy_((torch.randn(setup.numel, generator=gen) * 10).to(torch.bfloat16))
                eng.step(unscale=(None, 1 / 1000, 1.0)[k], clip_coef=(0.37, None, 0.61)[k])
            return [t.clone() for t in engine_state(eng)], model.params, bool(used)
    finally:
        paths_module.verified_fused_update = real


@settings(max_examples=examples(30), deadline=None, derandomize=True, print_blob=True)
@given(case=device_setups(), moments=st.tuples(st.sampled_from(list(DTYPES)), st.sampled_from(list(DTYPES))),
       remainders=st.booleans(), seed=st.integers(0, 3), on_model=st.booleans())
def test_one_pass_slicing_gives_the_multi_pass_bits(case, moments, remainders, seed, on_model):
    """(``on_model``: with remainders, the kernel on the model's params and the engine's grad buffer
    in place, else through copies of them)"""
    setup, extra, _ = case
    with tempfile.TemporaryDirectory() as a, tempfile.TemporaryDirectory() as b:
        ref_state, ref_model = _run(setup, extra, moments, remainders, False, seed, a)
        state, model = _run(setup, extra, moments, remainders, True, seed, b, on_model)
    for got, want in zip(state, ref_state):
        assert torch.equal(got.view(torch.uint8), want.view(torch.uint8))
    assert torch.equal(model.view(torch.uint8), ref_model.view(torch.uint8))


@pytest.mark.parametrize("dtypes", [codecs_for(("fp32", "fp32", "fp32")), codecs_for(("rem16", "bf16", "bf16"))],
                         ids=["fp32", "rem16"])
def test_the_start_up_check_rejects_a_kernel_one_ulp_off(dtypes):
    kernel = AdamKernel("single")
    reference = ReferenceOnePass(kernel, dtypes)
    assert matches(reference, kernel, dtypes, "cpu", numel=4096)

    def one_ulp_off(stored, grad, high, hyper, step, model=PLAIN):
        reference(stored, grad, high, hyper, step, model)
        m = stored[1]
        m.view(torch.int16 if m.dtype == torch.bfloat16 else torch.int32)[7] += 1
    assert not matches(one_ulp_off, kernel, dtypes, "cpu", numel=4096)


@pytest.mark.parametrize("dtypes", [codecs_for(("fp32", "fp32", "fp32")), codecs_for(("rem16", "bf16", "bf16"))],
                         ids=["fp32", "rem16"])
@pytest.mark.parametrize("fault", ["no clip", "clip first", "grads kept", "param not written"])
def test_the_start_up_check_rejects_a_kernel_wrong_on_the_model_buffers(dtypes, fault):
    """The check covers the model's own buffers too: unscale then clip, grads zeroed, the fp32
    master's param written (a kernel right only on fp32 grad copies is refused)."""
    kernel = AdamKernel("single")
    reference = ReferenceOnePass(kernel, dtypes)
    if fault == "param not written" and dtypes[0].needs_high:
        pytest.skip("a remainders master's param is its high half, updated in place")

    def wrong(stored, grad, high, hyper, step, model=PLAIN):
        if model is not PLAIN:
            if fault == "no clip":
                model = dataclasses.replace(model, clip_coef=None)
            elif fault == "clip first":  # the two multiplies in the other order round differently
                model = dataclasses.replace(model, unscale=model.clip_coef, clip_coef=model.unscale)
            elif fault == "grads kept":
                model = dataclasses.replace(model, zero_grad=False)
            else:
                model = dataclasses.replace(model, param_out=None)
        reference(stored, grad, high, hyper, step, model)
    assert matches(reference, kernel, dtypes, "cpu", numel=4096, on_model=True)
    assert not matches(wrong, kernel, dtypes, "cpu", numel=4096, on_model=True)


def test_variants_are_distinct_and_a_cpu_device_keeps_the_multi_pass_path():
    assert len(set(VARIANTS)) == 16
    fused, how = verified_fused_update("cpu", [FP32] * 3, AdamKernel("single"))
    assert fused is None and "multi-pass" in how


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the Triton kernel needs a CUDA device")
@pytest.mark.parametrize("master", ["fp32", "rem16", "fp16"])
@pytest.mark.parametrize("moments", [("fp32", "fp32"), ("bf16", "bf16"), ("fp16", "fp32")])
def test_fused_kernel_is_bit_identical_on_cuda(master, moments):
    """The engine's device kernel on CUDA is foreach (torch.optim.AdamW's default there, megatron-core's)."""
    kind = "foreach"
    kernel = AdamKernel(kind)
    dtypes = codecs_for((master, *moments))
    fused, how = verified_fused_update("cuda", dtypes, kernel)
    assert fused is not None, how
    assert fused.on_model_ok, how  # also on the model's own buffers
    # Independent of the engine's path: torch.optim.AdamW on the fp32 state, rounded as stored.
    for seed, hyper in enumerate(SAMPLE_HYPERS):
        stored, grad, high = sample_state(dtypes, 1 << 20, "cuda", seed + 10)
        master32 = stored[0].float() if master != "rem16" else (
            (high.view(torch.int16).int() << 16) + stored[0].int()).view(torch.float32)
        p = torch.nn.Parameter(master32.clone())
        opt = torch.optim.AdamW([p], lr=hyper.lr, betas=(hyper.beta1, hyper.beta2), eps=hyper.eps,
                                weight_decay=hyper.weight_decay, foreach=kind == "foreach")
        p.grad = torch.zeros_like(master32)
        opt.step()  # creates the state, then set to the sample's
        opt.state[p]["exp_avg"].copy_(stored[1].float())
        opt.state[p]["exp_avg_sq"].copy_(stored[2].float())
        opt.state[p]["step"].fill_(0)
        with torch.no_grad():
            p.copy_(master32)
        p.grad = grad.clone()
        opt.step()
        fused(stored, grad, high, hyper, 1)
        got_m, got_v = stored[1].float(), stored[2].float()
        assert torch.equal(got_m, opt.state[p]["exp_avg"].to(stored[1].dtype).float())
        assert torch.equal(got_v, opt.state[p]["exp_avg_sq"].to(stored[2].dtype).float())
        if master == "rem16":
            got = ((high.view(torch.int16).int() << 16) + stored[0].int()).view(torch.float32)
        else:
            got = stored[0].float()
        want = p.detach() if master != "fp16" else p.detach().half().float()
        assert torch.equal(got.view(torch.int32), want.view(torch.int32))


@pytest.mark.parametrize("remainders,moments", [(True, ("bf16", "bf16")), (False, ("fp32", "fp16"))])
def test_one_pass_engine_on_gpu_and_streamed_host_state_gives_the_multi_pass_bits(tmp_path, remainders, moments):
    """A fixed case that surely takes the one-pass path: the gpu tier and host state streamed
    through the device, chunks and two param groups cutting the subgroups unevenly."""
    from mlp_offload import OffloadConfig

    numel, sub = 23_457, 5_000
    groups = [([(0, 9_001)], {"weight_decay": 0.0}), ([(9_001, numel)], {})]
    states = []
    for one_pass in (False, True):
        cfg = OffloadConfig(tiers=["gpu", "host"], device="cpu", gpu_budget_bytes=2 * sub * 12, update_on="device",
                            device_chunk_elems=777, subgroup_size=sub, pin_memory=False, adam_kernel="single",
                            param_remainders=remainders, state_dtypes=("fp32", *moments), run_id=f"op{one_pass}",
                            adam_elems_per_s=1e9, device_adam_elems_per_s=4e9, device_streamed_elems_per_s=2e9)
        setup = type("S", (), {"numel": numel, "groups": groups})
        with tempfile.TemporaryDirectory() as root:
            states.append(_run_config(setup, cfg, remainders, one_pass))
    assert states[1][2] and not states[0][2]
    for got, want in zip([*states[1][0], states[1][1]], [*states[0][0], states[0][1]]):
        assert torch.equal(got.view(torch.uint8), want.view(torch.uint8))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the Triton kernel needs a CUDA device")
def test_a_kernel_no_variant_reproduces_keeps_the_multi_pass_path():
    """torch's single-tensor CUDA AdamW rounds unlike every variant (H200, torch 2.11): the start-up check
    must then keep the multi-pass path, or return a kernel that really matches."""
    dtypes = codecs_for(("rem16", "bf16", "bf16"))
    kernel = AdamKernel("single")
    fused, how = verified_fused_update("cuda", dtypes, kernel)
    if fused is None:
        assert "multi-pass" in how
    else:
        assert matches(fused, kernel, dtypes, "cuda", numel=1 << 16, steps=5)
