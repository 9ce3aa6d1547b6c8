"""The CPU update's one-pass kernel (mlp_offload.kernels.cpu_one_pass): every variant against a float32
reference written here in numpy (each operation rounded once, FMAs emulated exactly), over the
stored-dtype sets, weight decay on and off and both branches of lerp; the start-up check; the
engine with the one-pass path against the engine without it (remainders too, param groups, sizes
and subgroup cuts drawn) and against torch.optim.AdamW; a failed build keeps the multi-pass path."""

import dataclasses
import functools
import itertools
import logging
import os
import platform
import tempfile
from fractions import Fraction

import numpy as np
import pytest
import torch
from hypothesis import given, settings, strategies as st

from mlp_offload import ModelLink, OffloadConfig, OffloadedAdamW
from mlp_offload.kernels import cpu_one_pass as cop
from mlp_offload.kernels.fused_update import AdamHyper, Variant, sample_state
from mlp_offload.kernels.update import AdamKernel
from mlp_offload.state_formats import codecs_for

from .helpers import ModelParams, engine_state
from .strategies import setups
from tests.profiles import examples

pytestmark = pytest.mark.skipif(cop.extension() is None, reason=f"no CPU one-pass build: {cop.build_error()}")

F32 = np.float32
SETS = {name: codecs_for(name.split("/")) for name in
        ("fp32/fp32/fp32", "rem16/bf16/bf16", "rem16/fp32/fp32", "fp32/bf16/fp16")}
HYPERS = [AdamHyper(3e-4, 0.9, 0.95, 1e-8, 0.1), AdamHyper(1e-3, 0.9, 0.999, 1e-8, 0.0),
          AdamHyper(2e-3, 0.3, 0.95, 1e-6, 0.05), AdamHyper(1e-2, 0.3, 0.99, 1e-8, 0.0)]


def fma(a, b, c):
    """fp32 fma(a, b, c), correctly rounded, elementwise. Provably exact: a*b of two fp32 values
    is exact in float64 (48 significant bits of 53, and fp32's exponent range squared fits
    float64's). Its sum with c is computed in float64 by TwoSum, s + e == a*b + c exactly; s is
    then made round-to-odd (one ulp towards e where e != 0 and s's last bit is even), and a
    round-to-odd result with at least two more bits than the target (53 >= 24 + 2) rounds to
    float32 exactly as the exact sum would (Boldo & Melquiond, "Emulation of FMA and correctly
    rounded sums: proved algorithms using rounding to odd", IEEE Trans. Computers 2008)."""
    a, b, c = (np.broadcast_to(np.asarray(x, dtype=F32), np.broadcast(a, b, c).shape).astype(np.float64)
               for x in (a, b, c))
    prod = a * b
    s = prod + c
    bv = s - prod
    e = (prod - (s - bv)) + (c - bv)
    even = (s.view(np.int64) & 1) == 0
    s = np.where((e != 0) & even, np.nextafter(s, np.where(e > 0, np.inf, -np.inf)), s)
    return s.astype(F32)


def test_the_fma_emulation_is_exact_against_fractions():
    rng = np.random.default_rng(5)
    a = (rng.standard_normal(400) * np.exp2(rng.integers(-30, 30, 400))).astype(F32)
    b = (rng.standard_normal(400) * np.exp2(rng.integers(-30, 30, 400))).astype(F32)
    c = (-(a.astype(np.float64) * b) * (1 + rng.standard_normal(400) * 2.0 ** -rng.integers(1, 40, 400))).astype(F32)
    # half of them near-cancelling, where double rounding would show; the rest arbitrary
    c[::2] = (rng.standard_normal(200) * np.exp2(rng.integers(-60, 60, 200))).astype(F32)
    got = fma(a, b, c)
    for x, y, z, r in zip(a, b, c, got):
        exact = Fraction(float(x)) * Fraction(float(y)) + Fraction(float(z))
        lo = F32(float(exact))  # float(Fraction) is correctly rounded to float64: bracket from there
        cands = {lo, np.nextafter(lo, F32(np.inf)), np.nextafter(lo, F32(-np.inf))}
        best = min(cands, key=lambda t: (abs(Fraction(float(t)) - exact), int(np.asarray(t).view(np.int32)) & 1))
        assert np.asarray(r).view(np.int32) == np.asarray(best).view(np.int32), (x, y, z)


def _widen(t: torch.Tensor, high=None) -> np.ndarray:
    if t.dtype == torch.int16:  # (high half << 16) + remainder, int32 wrapping
        bits = (high.view(torch.int16).numpy().astype(np.int64) << 16) + t.numpy().astype(np.int64)
        return ((bits + 2 ** 31) % 2 ** 32 - 2 ** 31).astype(np.int32).view(F32)
    if t.dtype == torch.bfloat16:
        return (t.view(torch.int16).numpy().astype(np.uint16).astype(np.uint32) << 16).view(F32)
    if t.dtype == torch.float16:
        return t.view(torch.int16).numpy().view(np.float16).astype(F32)
    return t.numpy().copy()


def _store(x: np.ndarray, like: torch.Tensor, high=None) -> None:
    if like.dtype == torch.int16:  # transformer-engine's split: low half; high half + 1 where it is negative
        u = x.view(np.uint32)
        rem = (u & 0xFFFF).astype(np.int64)
        rem = np.where(rem >= 0x8000, rem - 0x10000, rem)
        hi = ((u >> 16).astype(np.int64) + (rem < 0)) & 0xFFFF
        like.copy_(torch.from_numpy(rem.astype(np.int16)))
        high.view(torch.int16).copy_(torch.from_numpy(hi.astype(np.uint16).view(np.int16)))
    elif like.dtype == torch.float16:
        like.copy_(torch.from_numpy(x.astype(np.float16)))
    else:  # bf16: round to nearest even, as Tensor.copy_ does
        like.copy_(torch.from_numpy(x))


def torch_sqrt_by_block(v: np.ndarray) -> np.ndarray:
    """torch's CPU sqrt called as the kernel calls it: block by block, one thread, 64-byte-aligned
    memory (torch's allocator), so neither a split across threads nor numpy's alignment enters."""
    out = np.empty_like(v)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        for lo in range(0, v.size, cop.BLOCK):
            out[lo:lo + cop.BLOCK] = torch.from_numpy(v[lo:lo + cop.BLOCK]).clone().sqrt().numpy()
    finally:
        torch.set_num_threads(threads)
    return out


@functools.lru_cache(maxsize=None)
def torch_sqrt_placement_dependence() -> str:
    """'' where torch's CPU sqrt gives a value the same bits wherever it lies (the input's and the
    output's alignment, a split across threads); otherwise what changed them. Where the bits depend
    on placement, "torch's sqrt" has no one value for a reference to hold the kernel to."""
    gen = torch.Generator().manual_seed(7)
    n = 2 * cop.BLOCK + 77
    x = torch.rand(n, generator=gen) * torch.exp2(torch.randint(-40, 4, (n,), generator=gen).float())
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        want = x.sqrt()
        for into, out_at in itertools.product(range(16), (0, 1, 3, 8)):
            moved = torch.empty(n + 16)[into:into + n].copy_(x)
            got = torch.empty(n + 16)[out_at:out_at + n]
            torch.sqrt(moved, out=got)
            if not torch.equal(got, want):
                return (f"input {into} and output {out_at} floats off 64-byte alignment: "
                        f"{int((got != want).sum())} differ")
        for k in (1, 13, 77, cop.BLOCK, cop.BLOCK + 5):
            if not torch.equal(torch.cat([x[:k].sqrt(), x[k:].sqrt()]), want):
                return f"a split at element {k} changes them"
        for count in (2, 4):
            torch.set_num_threads(count)
            if not torch.equal(x.sqrt(), want):
                return f"{count} threads change them"
    finally:
        torch.set_num_threads(threads)
    return ""


def cpu_model() -> str:
    lines = [line for line in open("/proc/cpuinfo") if line.startswith("model name")] if os.path.exists(
        "/proc/cpuinfo") else []
    return lines[0].split(":", 1)[1].strip() if lines else platform.processor() or platform.machine()


def skip_where_torch_sqrt_moves(consequence: str) -> None:
    if torch_sqrt_placement_dependence():
        pytest.skip(f"torch's CPU sqrt on this CPU ({cpu_model()}) depends on where a value lies "
                    f"({torch_sqrt_placement_dependence()}): {consequence}")


def reference_step(variant: cop.CpuVariant, stored, grad, high, h: AdamHyper, step: int) -> None:
    """The variant's AdamW step, one float32 operation at a time (numpy rounds each once)."""
    a = variant.arith
    p, m, v = (_widen(t, high if k == 0 else None) for k, t in enumerate(stored))
    g = grad.numpy()
    bc1, bc2_sqrt = 1 - h.beta1 ** step, (1 - h.beta2 ** step) ** 0.5
    w1, w2, beta2, eps, s = F32(1 - h.beta1), F32(1 - h.beta2), F32(h.beta2), F32(h.eps), F32(-(h.lr / bc1))
    if h.weight_decay != 0:
        p = p * F32(1 - h.lr * h.weight_decay)
    d = g - m
    if abs(w1) < 0.5:
        m = fma(w1, d, m) if a.fma_lerp else m + w1 * d
    else:
        m = fma(-d, F32(1) - w1, g) if a.fma_lerp else g - d * (F32(1) - w1)
    v = v * beta2
    if variant.torch_order:
        v = fma(w2 * g, g, v) if a.fma_addcmul else v + (w2 * g) * g
    else:
        v = fma(w2, g * g, v) if a.fma_addcmul else v + w2 * (g * g)
    root = torch_sqrt_by_block(v) if variant.torch_sqrt else np.sqrt(v)
    root = root * F32(1 / F32(bc2_sqrt)) if a.reciprocal_div else root / F32(bc2_sqrt)
    denom = root + eps
    if variant.torch_order:
        p = p + (s * m) / denom
    else:
        p = fma(s, m / denom, p) if a.fma_addcdiv else p + s * (m / denom)
    for k, (x, t) in enumerate(zip((p, m, v), stored)):
        _store(x.astype(F32), t, high if k == 0 else None)


def _bits(t):
    return t.view(torch.uint8)


@pytest.mark.parametrize("variant", cop.cpu_variants(), ids=lambda v: v.describe().replace(" ", "_"))
@pytest.mark.parametrize("name", list(SETS))
def test_kernel_equals_the_float32_reference(variant, name):
    if variant.torch_sqrt:
        skip_where_torch_sqrt_moves("the IEEE-sqrt variants check the rest")
    dtypes = SETS[name]
    kernel = cop.CpuOnePass(variant, dtypes)
    numel = 2 * cop.BLOCK + 77  # blocks and a short one
    for seed, hyper in enumerate(HYPERS):
        ours, grad, high = sample_state(dtypes, numel, "cpu", seed)
        ref, high_ref = [t.clone() for t in ours], high.clone()
        for step in (1, 2):
            kernel(ours, grad, high, hyper, step)
            reference_step(variant, ref, grad, high_ref, hyper, step)
        for got, want in zip(ours, ref):
            differ = int((got.view(torch.int16 if got.element_size() == 2 else torch.int32)
                          != want.view(torch.int16 if want.element_size() == 2 else torch.int32)).sum())
            assert differ == 0, (hyper, f"{differ} of {numel} elements differ on {cpu_model()}")
        assert torch.equal(_bits(high), _bits(high_ref))


def test_variants_differ_from_each_other_on_a_sample():
    """Each variant changes some bits (or the tests above would not tell them apart)."""
    results = {}
    for variant in cop.cpu_variants():
        stored, grad, high = sample_state(SETS["fp32/fp32/fp32"], 1 << 14, "cpu", 3)
        for step in (1, 2):
            cop.CpuOnePass(variant, SETS["fp32/fp32/fp32"])(stored, grad, high, HYPERS[step % 2], step)
        results[variant] = stored[0].numpy().tobytes() + stored[2].numpy().tobytes()
    assert len(set(results.values())) == len(results) == 48


@pytest.mark.parametrize("name", list(SETS))
def test_threads_and_cuts_do_not_change_the_bits(name):
    dtypes = SETS[name]
    # torch's sqrt where it gives each value one result wherever it lies (it is then what the cuts test)
    variant = next(v for v in cop.cpu_variants() if not (v.torch_sqrt and torch_sqrt_placement_dependence()))
    kernel = cop.CpuOnePass(variant, dtypes)
    whole, grad, high = sample_state(dtypes, 3 * cop.BLOCK + 5, "cpu", 1)
    pieces, high_p = [t.clone() for t in whole], high.clone()
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        kernel(whole, grad, high, HYPERS[0], 1)
    finally:
        torch.set_num_threads(threads)
    for lo, hi in ((0, 1), (1, 4100), (4100, 3 * cop.BLOCK + 5)):
        kernel([t[lo:hi] for t in pieces], grad[lo:hi], high_p[lo:hi], HYPERS[0], 1)
    for a, b in zip(whole + [high], pieces + [high_p]):
        assert torch.equal(_bits(a), _bits(b))


@pytest.mark.parametrize("kind", ["single", "foreach"])
@pytest.mark.parametrize("name", list(SETS))
def test_start_up_check_finds_torchs_cpu_variant(kind, name):
    skip_where_torch_sqrt_moves("the multi-pass path's bits are its placement's")
    kernel, how = cop.verified_cpu_one_pass(SETS[name], AdamKernel(kind))
    assert kernel is not None, how
    assert "one pass" in how and kernel.variant.torch_order


def test_fused_kernel_and_unmatched_variants_keep_the_multi_pass_path():
    kernel, how = cop.verified_cpu_one_pass(SETS["fp32/fp32/fp32"], AdamKernel("fused"))
    assert kernel is None and "multi-pass" in how
    device_like = cop.device_variant(Variant(True, True, True, False))
    kernel, how = cop.verified_cpu_one_pass(SETS["fp32/fp32/fp32"], AdamKernel("single"), [device_like])
    assert kernel is None and "tried 1" in how
    assert cop.cpu_one_pass_like(device_like.arith, SETS["fp32/fp32/fp32"]).variant == device_like


def test_a_failed_build_warns_once_and_keeps_the_multi_pass_path(monkeypatch, caplog):
    def no_compiler(name):
        raise RuntimeError("Error building extension: c++: not found")
    monkeypatch.setattr(cop, "import_built", lambda name: None)
    monkeypatch.setattr(cop, "_build", no_compiler)
    monkeypatch.setattr(cop, "_warned", False)
    cop.forget_extension()
    try:
        with caplog.at_level(logging.WARNING, logger="mlp_offload"):
            eng = OffloadedAdamW(torch.randn(1000), OffloadConfig(tiers=["host"], pin_memory=False,
                                                                  adam_kernel="single", adam_elems_per_s=1e9))
            with eng:
                eng.grad_buffer.copy_(torch.randn(1000).to(torch.bfloat16))
                eng.step()
                assert eng.update_paths.cpu_one_pass is None and "failed to build" in eng.cpu_one_pass_how
            with OffloadedAdamW(torch.randn(10), OffloadConfig(tiers=["host"], pin_memory=False,
                                                               adam_kernel="single", adam_elems_per_s=1e9)) as again:
                assert again.update_paths.cpu_one_pass is None
        warnings = [r for r in caplog.records if "one-pass" in r.getMessage()]
        assert len(warnings) == 1 and "c++: not found" in warnings[0].getMessage()
    finally:
        monkeypatch.undo()
        cop.forget_extension()
    assert cop.extension() is not None


def test_a_background_build_is_waited_for_and_built_once(monkeypatch):
    """The training layer starts the build before building its model; the engine's later call waits for
    that build instead of starting a second one."""
    import threading
    import time

    builds, started = [], threading.Event()

    def slow_build(name):
        started.set()
        time.sleep(0.3)
        builds.append(threading.current_thread().name)
        return "the module"
    monkeypatch.setattr(cop, "import_built", lambda name: None)
    monkeypatch.setattr(cop, "_build", slow_build)
    monkeypatch.setattr(cop, "_background", None)
    cop.forget_extension()
    try:
        cop.build_in_background()
        assert started.wait(5)
        assert cop.extension() == "the module" and cop.extension() == "the module"
        assert builds == ["mlp_offload cpu kernel build"]
    finally:
        monkeypatch.undo()
        cop.forget_extension()


def _run(setup, root, moments, remainders, one_pass, seed):
    cfg = dataclasses.replace(setup.config(root), param_remainders=remainders, state_dtypes=("fp32", *moments),
                              cpu_one_pass=one_pass)
    gen = torch.Generator().manual_seed(seed)
    init = torch.randn(setup.numel, generator=gen).to(torch.bfloat16 if remainders else torch.float32)
    model = ModelParams(init.clone())  # the bf16 params a remainders master's high halves come from
    kwargs = dict(model=ModelLink(on_params_updated=model.on_params, param_high=model.source)) if remainders else {}
    with OffloadedAdamW(init.clone(), cfg, lr=3e-3, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1,
                        groups=setup.groups, **kwargs) as eng:
        assert (eng.update_paths.cpu_one_pass is not None) == (one_pass and cfg.adam_kernel != "fused"), \
            eng.cpu_one_pass_how
        for _ in range(3):
            eng.grad_buffer.copy_((torch.randn(setup.numel, generator=gen) * 10).to(torch.bfloat16))
            eng.step()
        return [t.clone() for t in engine_state(eng)], model.params


@settings(max_examples=examples(30), deadline=None, print_blob=True)
@given(setup=setups(tier_mixes=(["host"], ["host", "nvme"]), probe=False, max_numel=60_000),
       moments=st.sampled_from([("fp32", "fp32"), ("bf16", "bf16"), ("bf16", "fp16")]),
       remainders=st.booleans(), seed=st.integers(0, 3))
def test_engine_one_pass_gives_the_multi_pass_bits(setup, moments, remainders, seed):
    with tempfile.TemporaryDirectory() as a, tempfile.TemporaryDirectory() as b:
        ref_state, ref_model = _run(setup, a, moments, remainders, False, seed)
        state, model = _run(setup, b, moments, remainders, True, seed)
    for got, want in zip(state, ref_state):
        assert torch.equal(_bits(got), _bits(want))
    assert torch.equal(_bits(model), _bits(ref_model))


def test_engine_one_pass_equals_torch_adamw():
    """Independent of the multi-pass path: torch.optim.AdamW (foreach=False), fp32 state."""
    numel, lr, betas, eps, wd = 37_777, 3e-3, (0.9, 0.95), 1e-8, 0.1
    gen = torch.Generator().manual_seed(0)
    init = torch.randn(numel, generator=gen)
    ref = torch.nn.Parameter(init.clone())
    opt = torch.optim.AdamW([ref], lr=lr, betas=betas, eps=eps, weight_decay=wd, foreach=False)
    cfg = OffloadConfig(tiers=["host"], pin_memory=False, adam_kernel="single", subgroup_size=10_000,
                        adam_elems_per_s=1e9)
    with OffloadedAdamW(init.clone(), cfg, lr=lr, betas=betas, eps=eps, weight_decay=wd) as eng:
        assert eng.update_paths.cpu_one_pass is not None, eng.cpu_one_pass_how
        for _ in range(4):
            grad = (torch.randn(numel, generator=gen) * 10).to(torch.bfloat16)
            eng.grad_buffer.copy_(grad)
            eng.step()
            ref.grad = grad.float()
            opt.step()
        params, exp_avg, exp_avg_sq = engine_state(eng)
    state = opt.state[ref]
    assert torch.equal(params, ref.detach())
    assert torch.equal(exp_avg, state["exp_avg"]) and torch.equal(exp_avg_sq, state["exp_avg_sq"])


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the Triton kernel needs a CUDA device")
@pytest.mark.parametrize("name", list(SETS))
def test_device_variant_gives_the_fused_device_kernels_bits(name):
    """cpu_one_pass_like(the device's verified variant): CPU-updated subgroups carry GPU bits."""
    from mlp_offload.kernels.fused_update import verified_fused_update

    dtypes = SETS[name]
    fused, how = verified_fused_update("cuda", dtypes, AdamKernel("foreach"))
    if fused is None:
        pytest.skip(how)
    cpu = cop.cpu_one_pass_like(fused.variant, dtypes)
    for seed, hyper in enumerate(HYPERS):
        ours, grad, high = sample_state(dtypes, 1 << 18, "cpu", seed)
        dev = [t.cuda() for t in ours]
        grad_dev, high_dev = grad.cuda(), high.cuda()
        for step in (1, 2, 3):
            cpu(ours, grad, high, hyper, step)
            fused(dev, grad_dev, high_dev, hyper, step)
        for got, want in zip(ours + [high], dev + [high_dev]):
            assert torch.equal(_bits(got), _bits(want.cpu()))


def test_the_flag_turns_the_cpu_one_pass_off():
    from megatron.training.args.arguments import parse_args
    from megatron.training.offload.flags import config_from_args

    base = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "32",
            "--micro-batch-size", "1", "--train-iters", "1", "--lr", "1e-3", "--mock-data", "--offload-tiers", "host"]
    assert config_from_args(parse_args(base), 0).cpu_one_pass
    assert not config_from_args(parse_args(base + ["--offload-no-cpu-one-pass"]), 0).cpu_one_pass


def test_the_cpu_kernel_takes_the_device_kernels_arithmetic_only_where_it_gives_its_bits():
    """On the CPU the device kernel's stand-in is the CPU kernel itself in one variant: asked for that
    variant it must be accepted; a device kernel one ulp off must be refused."""
    from mlp_offload.kernels.cpu_one_pass import cpu_one_pass_for_device, cpu_one_pass_like
    from mlp_offload.kernels.fused_update import VARIANTS

    dtypes = SETS["rem16/bf16/bf16"]
    variant = VARIANTS[0]
    same = cpu_one_pass_like(variant, dtypes)
    if same is None:
        pytest.skip("no C++ compiler: the one-pass kernel could not be built")

    class Device:
        def __init__(self, off_by_one):
            self.variant, self.off = variant, off_by_one

        def __call__(self, stored, grad, high, hyper, step):
            same(stored, grad, high, hyper, step)
            if self.off:
                stored[2].view(torch.int16)[3] += 1
    kernel, how = cpu_one_pass_for_device(Device(False), dtypes, "cpu", numel=4096)
    assert kernel is not None and "device kernel's arithmetic" in how
    kernel, how = cpu_one_pass_for_device(Device(True), dtypes, "cpu", numel=4096)
    assert kernel is None and "not reproduced" in how
