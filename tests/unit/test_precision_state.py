"""State stored narrower than fp32 (megatron-core's precision-aware optimizer): the engine against
an independent reference, torch.optim.AdamW on fp32 copies whose state is rounded to the stored
dtypes after every step; the smaller bytes in placement, prediction and checkpoints."""

import logging

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.profiles import examples

from mlp_offload import OffloadConfigError, OffloadedAdamW
from mlp_offload.checkpoint import load_engine_state
from mlp_offload.checkpoint.write import save_engine_state
from mlp_offload.state_formats import codecs_for
from mlp_offload.subgroups.partition import partition
from mlp_offload.config.align import align_up

from .helpers import BETAS, EPS, LR, WD, engine_state, fast_config

DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}
STEPS = 4


def reference_adamw(init, grads, dtypes, kernel):
    """torch.optim.AdamW in fp32; after each step the master params and both moments are rounded
    to their stored dtypes (as transformer-engine's FusedAdam stores precision-aware state)."""
    param_dtype, avg_dtype, sq_dtype = (DTYPES[d] for d in dtypes)
    p = torch.nn.Parameter(init.to(param_dtype).float())
    opt = torch.optim.AdamW([p], lr=LR, betas=BETAS, eps=EPS, weight_decay=WD,
                            foreach=kernel == "foreach", fused=kernel == "fused")
    for grad in grads:
        p.grad = grad.float()
        opt.step()
        state = opt.state[p]
        with torch.no_grad():
            p.copy_(p.to(param_dtype).float())
            state["exp_avg"].copy_(state["exp_avg"].to(avg_dtype).float())
            state["exp_avg_sq"].copy_(state["exp_avg_sq"].to(sq_dtype).float())
    state = opt.state[p]
    return p.detach(), state["exp_avg"], state["exp_avg_sq"]


def _config(tmp_path, tiers, numel, subgroup_size, dtypes, **overrides):
    options = dict(subgroup_size=subgroup_size, state_dtypes=dtypes, pin_memory=False, **overrides)
    if tiers == ["host", "nvme"]:  # room for three pipeline buffers and two resident subgroups
        slot = partition(numel, subgroup_size, codecs_for(dtypes))[0].state_bytes
        options["host_budget_bytes"] = 5 * slot
    return fast_config(tmp_path, tiers, **options)


def run_engine(config, init, grads):
    with OffloadedAdamW(init.clone(), config, lr=LR, betas=BETAS, eps=EPS, weight_decay=WD) as eng:
        for grad in grads:
            eng.grad_buffer.copy_(grad)
            eng.step()
        return [t.float() for t in engine_state(eng)], eng.placement.tier_of


@settings(max_examples=examples(25), deadline=None, derandomize=True, print_blob=True)
@given(dtypes=st.tuples(st.sampled_from(["fp32", "fp16", "bf16"]), st.sampled_from(["fp32", "fp16", "bf16"]),
                        st.sampled_from(["fp32", "fp16", "bf16"])),
       tiers=st.sampled_from([["host"], ["nvme"], ["host", "nvme"]]),
       numel=st.integers(1, 30_000), pieces=st.integers(1, 6), kernel=st.sampled_from(["fused", "foreach"]),
       seed=st.integers(0, 1000))
def test_engine_matches_fp32_adamw_rounded_to_stored_dtypes(tmp_path_factory, dtypes, tiers, numel, pieces,
                                                            kernel, seed):
    gen = torch.Generator().manual_seed(seed)
    init = torch.randn(numel, generator=gen)
    grads = [(torch.randn(numel, generator=gen) * 10).to(torch.bfloat16) for _ in range(STEPS)]
    subgroup_size = -(-numel // pieces)
    config = _config(tmp_path_factory.mktemp("tiers"), tiers, numel, subgroup_size, dtypes, adam_kernel=kernel)
    got, tier_of = run_engine(config, init, grads)
    expected = reference_adamw(init, grads, dtypes, kernel)
    for name, g, e in zip(("param", "exp_avg", "exp_avg_sq"), got, expected):
        assert torch.equal(g, e), (name, dtypes, tier_of)


def test_file_tier_is_used_by_the_mixed_setup(tmp_path):
    """The host+file case above really streams subgroups through its file tier."""
    numel, size = 20_000, 4_000
    config = _config(tmp_path, ["host", "nvme"], numel, size, ("fp16", "bf16", "bf16"))
    _, tier_of = run_engine(config, torch.randn(numel), [torch.randn(numel).bfloat16()])
    assert "nvme" in tier_of and "host" in tier_of


def test_bf16_moments_store_8_bytes_per_param_plus_alignment(tmp_path, caplog):
    n = 4 * 4096  # a multiple of the alignment: padding adds nothing, so the ratio is exact
    narrow = partition(3 * n, n, codecs_for(("fp32", "bf16", "bf16")))
    assert [sg.state_bytes for sg in narrow] == [8 * n] * 3
    odd = partition(1000, 1000, codecs_for(("fp32", "bf16", "bf16")))[0]
    assert odd.state_bytes == align_up(4000) + 2 * align_up(2000)
    assert [odd.region_offset(k) for k in range(3)] == [0, align_up(4000), align_up(4000) + align_up(2000)]

    def planned(dtypes, sub):
        config = fast_config(tmp_path / sub, ["nvme"], subgroup_size=n, state_dtypes=dtypes, pin_memory=False)
        with caplog.at_level(logging.INFO, logger="mlp_offload"):
            with OffloadedAdamW(torch.zeros(3 * n), config) as eng:
                return eng.state_bytes_per_tier(), eng.prediction

    wide_bytes, wide_pred = planned(("fp32", "fp32", "fp32"), "a")
    assert "state 12.0 B/param" in caplog.text
    narrow_bytes, narrow_pred = planned(("fp32", "bf16", "bf16"), "b")
    assert "state 8.0 B/param" in caplog.text
    assert narrow_bytes["nvme"] == 3 * 8 * n and wide_bytes["nvme"] == 3 * 12 * n
    assert narrow_bytes["host"] * 3 == wide_bytes["host"] * 2  # the pipeline buffers shrink too
    assert narrow_pred.read_bytes["nvme"] * 3 == wide_pred.read_bytes["nvme"] * 2
    assert narrow_pred.write_bytes["nvme"] * 3 == wide_pred.write_bytes["nvme"] * 2


@pytest.mark.parametrize("saved,loaded", [(("fp32", "fp32", "fp32"), ("fp16", "bf16", "bf16")),
                                          (("fp16", "bf16", "fp16"), ("fp32", "fp32", "fp32"))])
def test_checkpoint_loads_into_other_state_dtypes_by_rounding_or_widening(tmp_path, saved, loaded):
    numel = 12_345
    init, grads = torch.randn(numel), [torch.randn(numel).bfloat16() for _ in range(2)]
    path = str(tmp_path / "state.bin")
    with OffloadedAdamW(init.clone(), _config(tmp_path / "a", ["host", "nvme"], numel, 5_000, saved)) as eng:
        for grad in grads:
            eng.grad_buffer.copy_(grad)
            eng.step()
        before = [t.float() for t in engine_state(eng)]
        save_engine_state(eng, path)
    with OffloadedAdamW(torch.zeros(numel), _config(tmp_path / "b", ["host", "nvme"], numel, 3_000, loaded)) as eng:
        load_engine_state(eng, path)
        after = [t.float() for t in engine_state(eng)]
        assert eng.steps_done == 2
    for b, a, dtype in zip(before, after, loaded):
        assert torch.equal(a, b.to(DTYPES[dtype]).float())


def test_fp8_for_one_moment_only_is_refused_with_one_line():
    with pytest.raises(OffloadConfigError, match=r"state dtypes \(state_dtypes\[1\], state_dtypes\[2\]\) are fp8/fp32"):
        fast_config(None, ["host"], state_dtypes=("fp32", "fp8", "fp32"))
