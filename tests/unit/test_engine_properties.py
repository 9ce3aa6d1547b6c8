"""Properties over random configurations: every valid one starts (probing its tiers where no
bandwidths are given) and updates exactly as torch.optim.AdamW does; every invalid one fails at
construction with an error that names the setting and the bad value."""

import os
import tempfile
from dataclasses import dataclass, replace
from typing import List, Optional

import pytest
import torch
from hypothesis import example, given, settings
from hypothesis import strategies as st

from tests.profiles import examples

from mlp_offload import ModelLink
from mlp_offload import (
    HostMemoryError, OffloadConfigError, OffloadedAdamW, PlacementError, TierPathError, parse_bandwidths,
)
from mlp_offload.subgroups.partition import partition

from .helpers import BETAS, EPS, LR, WD, adamw_reference, assert_state_equals_reference
from .strategies import TIER_MIXES, MiB, Setup, fixed_setup, setups

NAN, INF = float("nan"), float("inf")


@settings(max_examples=examples(100), deadline=None, derandomize=True, print_blob=True)
@given(setup=setups(), grad_dtype=st.sampled_from([torch.bfloat16, torch.float16]),
       scaling=st.sampled_from([(None, None), (1 / 1024, 0.37)]), seed=st.integers(0, 1000))
# Probed at start: 48 MiB in 8 MiB blocks (it crashed), with three ranks' streams, no cache.
@example(setup=fixed_setup(["nvme", "pfs"], 120_000, subgroup_size=15_000, bandwidths={}, probe_bytes=48 * MiB,
                           io_block_bytes=8 * MiB, ranks_sharing_node=3, cache_alternating=False,
                           adam_kernel="foreach"),
         grad_dtype=torch.float16, scaling=(1 / 1024, 0.37), seed=1)
# Two residents beside a full pipeline (5 buffers of 3 x 80 KiB) over two file tiers; groups cut
# at odd offsets.
@example(setup=fixed_setup(["host", "nvme", "pfs"], 200_000, subgroup_size=20_000, host_budget_bytes=7 * 3 * 81_920,
                           use_odirect=False, verify_checksums=False,
                           groups=[([(0, 12_345), (90_001, 200_000)], {}),
                                   ([(12_345, 90_001)], {"lr": 1e-2, "weight_decay": 0.0})]),
         grad_dtype=torch.bfloat16, scaling=(None, None), seed=2)
def test_valid_configurations_start_and_match_torch_adamw(setup, grad_dtype, scaling, seed):
    gen = torch.Generator().manual_seed(seed)
    init = torch.randn(setup.numel, generator=gen)
    pieces, opt = adamw_reference(setup, init, setup.options["adam_kernel"])
    unscale, clip = scaling
    with tempfile.TemporaryDirectory() as root:
        with OffloadedAdamW(init.clone(), setup.config(root), lr=LR, betas=BETAS, eps=EPS, weight_decay=WD,
                            groups=setup.groups, model=ModelLink(grad_dtype=grad_dtype)) as eng:
            for _ in range(3):
                grad = (torch.randn(setup.numel, generator=gen) * 10).to(grad_dtype)
                eng.grad_buffer.copy_(grad)
                eng.step(unscale=unscale, clip_coef=clip)
                g32 = grad.float()
                if unscale is not None:  # as megatron-core does: unscale, then clip
                    g32.mul_(unscale).mul_(clip)
                for (a, b), p in pieces:
                    p.grad = g32[a:b].clone()
                opt.step()
            assert_state_equals_reference(eng, pieces, opt)


@dataclass
class Invalid:
    """A set-up made invalid by one change, the error it must raise and what its message must say."""

    setup: Setup
    error: type
    says: List[str]
    bandwidth_spec: Optional[str] = None  # parsed as --offload-bandwidths is
    missing_path: Optional[str] = None  # a file tier whose directory is replaced by a missing one


def _changed(setup: Setup, error=OffloadConfigError, says=None, **options) -> Invalid:
    """``setup`` with ``options`` changed; by default the error names the option and its value."""
    if says is None:
        (name, value), = options.items()
        says = [name, repr(value)]
    return Invalid(replace(setup, options={**setup.options, **options}), error, says)


BAD_INTS = [0, -1, True, False, 2.0, 1.5]  # bools and floats where an int is needed


def _bad(name, values):
    """The set-up with option ``name`` set to one of ``values``."""
    return lambda draw, setup: _changed(setup, **{name: draw(st.sampled_from(values))})


def _bad_block(draw, setup):
    block = draw(st.one_of(st.builds(lambda k, r: 4096 * k + r, st.integers(0, 4096), st.integers(1, 4095)),
                           st.sampled_from([0, -4096, 8192.0, True])))
    return _changed(setup, io_block_bytes=block)


def _bad_bandwidth_flag(draw, setup):
    tier = setup.tiers[-1]
    spec = f"{tier}=" + draw(st.sampled_from(["inf:1", "1:nan", "0:1", "1:1e999", "-1:1"]))
    return Invalid(setup, OffloadConfigError, ["bandwidths", repr(spec)], bandwidth_spec=spec)


def _bad_bandwidth(draw, setup):
    tier = setup.tiers[-1]
    rate = draw(st.sampled_from([(NAN, 1e9), (1e9, INF), (0, 1e9), (1e9, 1e9, -1.0)]))
    return _changed(setup, bandwidths={tier: rate}, says=[f"bandwidths[{tier!r}]", repr(rate)])


def _probe_too_small(draw, setup):
    # The probe gives each read in flight a file of two pages at the least.
    depth = draw(st.integers(129, 1000))
    return _changed(setup, bandwidths={}, probe_bytes=MiB, prefetch_depth=depth,
                    says=["probe_bytes=1048576", f"prefetch_depth={depth}"])


def _missing_path(draw, setup):
    tier = setup.tiers[-1]
    return Invalid(setup, TierPathError, [f"paths[{tier!r}]", "no-such-dir"], missing_path=tier)


def _host_only_budget_below_state(draw, setup):
    total = sum(sg.state_bytes for sg in partition(setup.numel, setup.options["subgroup_size"]))
    budget = draw(st.integers(0, total - 1))
    if budget == 0:
        return _changed(setup, host_budget_bytes=0)
    return _changed(setup, host_budget_bytes=budget, error=PlacementError,
                    says=[f"host_budget_bytes={budget}"])


def _budget_below_pipeline(draw, setup):
    budget = draw(st.integers(0, 2 * setup.slot_bytes - 1))
    return _changed(setup, host_budget_bytes=budget, error=PlacementError,
                    says=[f"host_budget_bytes={budget}"])


WITH_FILES = [m for m in TIER_MIXES if m != ["host"]]
HOST_AND_FILES = [m for m in WITH_FILES if "host" in m]
# kind -> (the tier mixes it applies to, what makes a drawn set-up invalid)
INVALID = {
    "host_budget_bytes": (TIER_MIXES, _bad("host_budget_bytes",
                                           [INF, -INF, NAN, -1, -(1 << 30), 1.5e9, float(1 << 30), True])),
    "probe_bytes": (TIER_MIXES, _bad("probe_bytes", [0, -1, MiB - 1, 4096, float(2 * MiB), True])),
    "io_block_bytes": (TIER_MIXES, _bad_block),
    "prefetch_depth": (TIER_MIXES, _bad("prefetch_depth", BAD_INTS)),
    "subgroup_size": (TIER_MIXES, _bad("subgroup_size", BAD_INTS + [1e5])),
    "io_threads": (TIER_MIXES, _bad("io_threads", BAD_INTS)),
    "tokens_per_tier": (TIER_MIXES, _bad("tokens_per_tier", BAD_INTS)),
    "ranks_sharing_node": (TIER_MIXES, _bad("ranks_sharing_node", BAD_INTS)),
    "adam_elems_per_s": (TIER_MIXES, _bad("adam_elems_per_s", [0, -1.0, INF, NAN, True])),
    "lock_dir": (TIER_MIXES, _bad("lock_dir", ["", 3, b"/tmp"])),
    "local_rank": (TIER_MIXES, _bad("local_rank", [-1, True, 2.0, 1.5, "0"])),
    "adam_kernel": (TIER_MIXES, _bad("adam_kernel", ["turbo", "Fused", ""])),
    "pin_memory": (TIER_MIXES, lambda draw, setup: _changed(setup, pin_memory=True, error=HostMemoryError,
                                                            says=["pin_memory=True"])),
    "bandwidths flag": (WITH_FILES, _bad_bandwidth_flag),
    "bandwidths": (WITH_FILES, _bad_bandwidth),
    "probe too small": (WITH_FILES, _probe_too_small),
    "missing path": (WITH_FILES, _missing_path),
    "host-only budget": ([["host"]], _host_only_budget_below_state),
    "budget below the pipeline": (HOST_AND_FILES, _budget_below_pipeline),
    "no budget": (HOST_AND_FILES, lambda draw, setup: _changed(
        setup, host_budget_bytes=None, says=["no host budget", "host_budget_bytes"])),
}


@pytest.mark.parametrize("kind", [pytest.param(k, marks=pytest.mark.skipif(
    k == "pin_memory" and torch.cuda.is_available(), reason="pinning works where CUDA is")) for k in INVALID])
@settings(max_examples=examples(20), deadline=None, derandomize=True, print_blob=True)
@given(data=st.data())
def test_invalid_configurations_fail_at_construction_naming_the_setting(kind, data):
    mixes, make_invalid = INVALID[kind]
    bad = make_invalid(data.draw, data.draw(setups(tier_mixes=mixes, probe=False, max_numel=50_000)))
    with tempfile.TemporaryDirectory() as root:
        with pytest.raises(bad.error) as info:
            if bad.bandwidth_spec is not None:
                parse_bandwidths(bad.bandwidth_spec)
            cfg = bad.setup.config(root)
            if bad.missing_path is not None:
                cfg.paths[bad.missing_path] = os.path.join(root, "no-such-dir")
            OffloadedAdamW(torch.zeros(bad.setup.numel), cfg).close()
    message = str(info.value)
    for words in bad.says:
        assert words in message, (words, message)
