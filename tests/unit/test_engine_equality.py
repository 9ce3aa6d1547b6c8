"""The engine's AdamW must equal torch.optim.AdamW bit for bit, wherever its state lives."""

import pytest
import torch

from mlp_offload import ModelLink
from mlp_offload import OffloadConfig, OffloadedAdamW

from .helpers import BETAS, EPS, LR, WD, engine_state, fast_config


def assert_equals_adamw(cfg, numel, grad_dtype, steps=5, seed=0, unscale=None, clip=None, kernel_fused=True):
    """Run the engine and torch.optim.AdamW side by side on identical gradients; assert the engine's
    params and moments equal torch's bit for bit; return the engine's step records."""
    gen = torch.Generator().manual_seed(seed)
    init = torch.randn(numel, generator=gen)
    ref = torch.nn.Parameter(init.clone())
    opt = torch.optim.AdamW([ref], lr=LR, betas=BETAS, eps=EPS, weight_decay=WD,
                            fused=kernel_fused, foreach=False if not kernel_fused else None)
    eng = OffloadedAdamW(init.clone(), cfg, lr=LR, betas=BETAS, eps=EPS, weight_decay=WD,
                         model=ModelLink(grad_dtype=grad_dtype))
    records = []
    try:
        for _ in range(steps):
            grad = (torch.randn(numel, generator=gen) * 10).to(grad_dtype)
            eng.grad_buffer.copy_(grad)
            records.append(eng.step(unscale=unscale, clip_coef=clip))
            g32 = grad.float()
            if unscale is not None:
                g32.mul_(unscale)
            if clip is not None:
                g32.mul_(clip)
            ref.grad = g32
            opt.step()
        params, exp_avg, exp_avg_sq = engine_state(eng)
    finally:
        eng.close()
    state = opt.state[ref]
    assert torch.equal(params, ref.detach()), (params - ref.detach()).abs().max()
    assert torch.equal(exp_avg, state["exp_avg"])
    assert torch.equal(exp_avg_sq, state["exp_avg_sq"])
    return records


@pytest.mark.parametrize("numel", [1, 1000, 4096 * 3 + 7, 250_001])
@pytest.mark.parametrize("grad_dtype", [torch.bfloat16, torch.float16])
def test_host_only(numel, grad_dtype):
    assert_equals_adamw(OffloadConfig(tiers=["host"], subgroup_size=40_000), numel, grad_dtype)


@pytest.mark.parametrize("numel", [1000, 4096 * 3 + 7, 250_001])
@pytest.mark.parametrize("cache", [True, False])
def test_file_only_one_path(tmp_path, numel, cache):
    sub = 3_000
    cfg = fast_config(tmp_path, tiers=["nvme"], subgroup_size=sub, cache_alternating=cache)
    records = assert_equals_adamw(cfg, numel, torch.bfloat16)
    # No host tier: 3 pipeline buffers (depth 2 + 1), 2 of them kept as cache across steps. State
    # that fits the cache entirely never needs to leave host memory.
    subgroups = -(-numel // sub)
    wrote = sum(r.tiers["nvme"].write_bytes for r in records)
    assert (wrote > 0) == (not cache or subgroups > 2)


@pytest.mark.parametrize("paths", [1, 2, 3])
@pytest.mark.parametrize("grad_dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("cache", [True, False])
def test_mixed_tiers(tmp_path, paths, grad_dtype, cache):
    tiers = ["host"] + ["nvme", "pfs", "burst"][:paths]
    # Budget: 2 resident subgroups beside the pipeline buffers, so host and files both hold state.
    sub = 20_000
    slot = 3 * ((sub * 4 + 4095) // 4096 * 4096)
    cfg = fast_config(tmp_path, tiers=tiers, subgroup_size=sub, cache_alternating=cache,
                      host_budget_bytes=(2 * paths + 1 + 2) * slot)
    records = assert_equals_adamw(cfg, 10 * sub + 1234, grad_dtype, steps=6)
    for tier in tiers[1:]:
        assert sum(r.tiers[tier].read_bytes for r in records) > 0, tier
    assert records[-1].resident == 2
    if cache:
        assert records[-1].cache_hits >= 1
    else:
        assert all(r.cache_hits == 0 for r in records)


def test_unscale_and_clip_applied_in_megatron_order(tmp_path):
    cfg = fast_config(tmp_path, tiers=["nvme"], subgroup_size=10_000)
    assert_equals_adamw(cfg, 33_333, torch.float16, unscale=1 / 1024, clip=0.37)


def test_unfused_kernel_matches_unfused_adamw(tmp_path):
    cfg = fast_config(tmp_path, tiers=["nvme"], subgroup_size=10_000, adam_kernel="single")
    assert_equals_adamw(cfg, 25_000, torch.bfloat16, kernel_fused=False)


@pytest.mark.parametrize("kernel", ["single", "fused"])
def test_param_groups_and_lr_changes(tmp_path, kernel):
    """Groups with their own lr/weight decay, changed between steps as a scheduler would.

    The group ranges start at odd offsets (12345), so subgroup boundaries cut them at points that
    are not multiples of the CPU's vector width. Both kernels stay bit-identical. (Scalar and
    vector code differ on few elements, so this data may not reach a difference at these cuts:
    test_fused_kernel_on_slices_equals_one_call_over_the_tensor is the one that does.)"""
    numel, sub = 50_000, 8_000
    cfg = fast_config(tmp_path, tiers=["nvme", "pfs"], subgroup_size=sub, adam_kernel=kernel)
    init = torch.randn(numel)
    ranges_a, ranges_b = [(0, 12_345), (30_000, 50_000)], [(12_345, 30_000)]
    eng = OffloadedAdamW(init.clone(), cfg, lr=LR, betas=BETAS, eps=EPS, weight_decay=WD,
                         groups=[(ranges_a, {}), (ranges_b, {"weight_decay": 0.0, "lr": 1e-2})])
    pieces = [torch.nn.Parameter(init[a:b].clone()) for a, b in ranges_a + ranges_b]
    opt = torch.optim.AdamW(
        [{"params": pieces[:2]}, {"params": pieces[2:], "weight_decay": 0.0, "lr": 1e-2}],
        lr=LR, betas=BETAS, eps=EPS, weight_decay=WD,
        fused=kernel == "fused", foreach=False if kernel == "single" else None)
    try:
        for step in range(4):
            grad = torch.randn(numel).to(torch.bfloat16)
            eng.grad_buffer.copy_(grad)
            for group_e, group_r in zip(eng.param_groups, opt.param_groups):
                group_e["lr"] = group_r["lr"] = group_r["lr"] * 0.5
            eng.step()
            for p, (a, b) in zip(pieces, ranges_a + ranges_b):
                p.grad = grad[a:b].float()
            opt.step()
        params, _, _ = engine_state(eng)
    finally:
        eng.close()
    for p, (a, b) in zip(pieces, ranges_a + ranges_b):
        assert torch.equal(params[a:b], p.detach()), (kernel, a, b, int((params[a:b] != p.detach()).sum()))


def test_skip_leaves_state_untouched(tmp_path):
    cfg = fast_config(tmp_path, tiers=["nvme"], subgroup_size=5_000)
    init = torch.randn(12_000)
    with OffloadedAdamW(init.clone(), cfg) as eng:
        eng.grad_buffer.copy_(torch.randn(12_000).to(torch.bfloat16))
        rec = eng.step(skip=True)
        assert rec.skipped and eng.steps_done == 0
        params, exp_avg, _ = engine_state(eng)
        assert torch.equal(params, init) and not exp_avg.any()


def test_callback_sees_every_updated_subgroup_once(tmp_path):
    cfg = fast_config(tmp_path, tiers=["host", "nvme"], subgroup_size=4_000, host_budget_bytes=6 * 3 * 16384)
    seen = []
    out = torch.zeros(17_000)

    def copy_back(start, end, params):
        seen.append((start, end))
        out[start:end].copy_(params)

    with OffloadedAdamW(torch.randn(17_000), cfg, model=ModelLink(on_params_updated=copy_back)) as eng:
        for step in range(3):
            seen.clear()
            eng.grad_buffer.normal_()
            eng.step()
            assert sorted(seen) == [(sg.start, sg.end) for sg in eng.subgroups]
            order = [s for s, _ in seen]
            assert order == sorted(order, reverse=step % 2 == 1)  # alternating order
        params, _, _ = engine_state(eng)
    assert torch.equal(out, params)


def test_prefetch_and_flush_hooks(tmp_path):
    cfg = fast_config(tmp_path, tiers=["nvme"], subgroup_size=5_000, cache_alternating=False)
    with OffloadedAdamW(torch.randn(40_000), cfg) as eng:
        eng.grad_buffer.normal_()
        eng.step()
        eng.flush()
        eng.prefetch()
        eng.grad_buffer.normal_()
        rec = eng.step()
        assert rec.tiers["nvme"].read_bytes > 0 and rec.tiers["nvme"].write_bytes > 0


class _InFlightGradients:
    """A gradient source that behaves like an asynchronous copy: ``out`` holds garbage (NaN) from
    start() until wait(). If the engine used a buffer whose next copy had begun, Adam would see NaN."""

    def __init__(self):
        self.grads = None
        self.pending = {}

    def start(self, start, end, out, unscale, clip_coef):
        out.fill_(float("nan"))
        self.pending[start] = (end, out, unscale, clip_coef)

    def wait(self, start):
        end, out, unscale, clip_coef = self.pending.pop(start)
        from mlp_offload.kernels.update import convert_grads
        convert_grads(self.grads[start:end], out, unscale, clip_coef)


@pytest.mark.parametrize("tiers", [["host"], ["nvme", "pfs"]])
def test_gradient_source_double_buffering(tmp_path, tiers):
    numel = 45_678
    source = _InFlightGradients()
    init = torch.randn(numel)
    ref = torch.nn.Parameter(init.clone())
    opt = torch.optim.AdamW([ref], lr=LR, betas=BETAS, eps=EPS, weight_decay=WD, fused=True)
    cfg = fast_config(tmp_path, tiers=tiers, subgroup_size=7_000)
    with OffloadedAdamW(init.clone(), cfg, lr=LR, betas=BETAS, eps=EPS, weight_decay=WD,
                        model=ModelLink(grad_source=source)) as eng:
        assert eng.grad_buffer is None
        for _ in range(4):
            source.grads = (torch.randn(numel) * 3).to(torch.bfloat16)
            eng.step(unscale=0.5, clip_coef=0.9)
            ref.grad = source.grads.float().mul_(0.5).mul_(0.9)
            opt.step()
        assert not source.pending
        params, _, _ = engine_state(eng)
    assert torch.equal(params, ref.detach())


def test_fused_kernel_on_slices_equals_one_call_over_the_tensor():
    # Slices of 13 elements: without their span, 5 of each 13 would take the scalar tail.
    from mlp_offload.kernels.update import AdamKernel, fused_vector_width

    kernel, n = AdamKernel("fused"), 20_011
    gen = torch.Generator().manual_seed(1)
    base = [torch.randn(n, generator=gen), torch.randn(n, generator=gen),
            torch.randn(n, generator=gen) * 1e-2, torch.rand(n, generator=gen) * 1e-4]
    hyper = dict(step=3, lr=1e-2, beta1=0.9, beta2=0.95, eps=1e-8, weight_decay=0.1)

    def sliced(with_span):
        state = [t.clone() for t in base]
        for a in range(0, n, 13):
            kernel(*(t[a:a + 13] for t in state), **hyper, span=(a, n) if with_span else None)
        return state

    whole = [t.clone() for t in base]
    kernel(*whole, **hyper)
    for got, want in zip(sliced(True), whole):
        assert torch.equal(got, want)
    if fused_vector_width() > 1:  # the data does reach the path where scalar and vector code differ
        assert not torch.equal(sliced(False)[0], whole[0])
