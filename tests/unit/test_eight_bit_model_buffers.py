"""The device's 8-bit update on the model's own buffers (``eight_bit.EightBitUpdate.model_step``).

The model's grads and params come in pieces cut where its DDP buffers end (``PiecedSource``), unlike
the subgroup, its param groups (with padding between them) and its params' blocks. Where every cut
falls on a block start, each piece is one launch of the one pass on the model's buffers; where one
falls inside a block, the subgroup goes through copies. Either way the state, the model's params and
its grads must be left as the path through copies leaves them: grads converted into an fp32 buffer
(unscaled, clipped, zeroed as read), the bf16 high halves copied in, the params copied back out. On
the CPU the one pass is the reference's passes (``blockwise8.adamw_step_model``: the slicing is what
runs here); on CUDA, the Triton kernel.
"""

import pytest
import torch
from hypothesis import given, settings, strategies as st

from mlp_offload.gradients import ModelBuffers
from mlp_offload.kernels import blockwise8
from mlp_offload.kernels.fused_update import AdamHyper
from mlp_offload.kernels.remainders import split
from mlp_offload.state_formats import Blockwise8, codecs_for
from mlp_offload.step.device_side import DeviceJob, DeviceKernel, DeviceUpdate
from mlp_offload.step.eight_bit import EightBitKernel, EightBitUpdate, choose_kernel
from mlp_offload.subgroups.blocks import ShardParams, pieces_of
from mlp_offload.subgroups.partition import Subgroup
from tests.profiles import examples

from .test_model_buffers import PiecedSource, copies_io, same_bits

HYPERS = (AdamHyper(3e-4, 0.9, 0.95, 1e-8, 0.1), AdamHyper(1e-3, 0.8, 0.999, 1e-6, 0.0))


@st.composite
def cases(draw):
    block = draw(st.sampled_from([4, 8, 16]))
    total = draw(st.integers(2, 160))
    cuts = sorted(set(draw(st.lists(st.integers(1, total - 1), max_size=5))))
    edges = [0, *cuts, total]
    segments = [(a, draw(st.sampled_from([0, 0, 3, 17])), b - a) for a, b in zip(edges, edges[1:])]
    params = ShardParams(segments, total)
    starts = [p for p in range(total + 1) if params.is_block_start(p, block)]
    base, end = sorted(draw(st.lists(st.sampled_from(starts), min_size=2, max_size=2, unique=True)))
    inner = [p for p in starts if base < p < end]
    middle = sorted(set(draw(st.lists(st.sampled_from(inner), max_size=3)))) if inner else []
    bounds = [base, *middle, end]
    owners = [draw(st.sampled_from([0, 1, None])) for _ in bounds[1:]]
    groups = [(a - base, b - base, g, (0, b - a)) for a, b, g in zip(bounds, bounds[1:], owners) if g is not None]
    aligned = draw(st.booleans())  # the model's buffers cut on block starts only, or anywhere
    anywhere = st.integers(1, total - 1)
    buffer_cut = st.sampled_from([p for p in starts if 0 < p < total] or [1]) if aligned else anywhere
    return dict(
        block=block, total=total, params=params, base=base, end=end, groups=groups,
        resident=draw(st.booleans()), remainders=draw(st.booleans()),
        grad_dtype=draw(st.sampled_from([torch.bfloat16, torch.float16, torch.float32])),
        unscale=draw(st.sampled_from([None, 1.0, 1 / 1000])), clip=draw(st.sampled_from([None, 0.37])),
        zero=draw(st.booleans()), seed=draw(st.integers(0, 99)),
        grad_cuts=draw(st.lists(buffer_cut, max_size=3)), param_cuts=draw(st.lists(buffer_cut, max_size=3)))


def _codecs(c):
    return (codecs_for(("rem16",))[0] if c["remainders"] else codecs_for(("fp32",))[0],
            Blockwise8("e4m3", c["block"]), Blockwise8("sqrt-e4m3", c["block"]))


def _kernel(device, codecs) -> EightBitKernel:
    if device == "cpu":  # the torch path: the slicing is under test here, not the C++ kernel
        return EightBitKernel(blockwise8.adamw_step, "torch path", True, blockwise8.adamw_step_model)
    kernel = choose_kernel(device, codecs)
    assert kernel.on_model is not None, kernel.how
    return kernel


def _run(c, on_model: bool, device: str = "cpu"):
    """Two steps of the subgroup's update; its state, the model's grads (the last step's) and params."""
    codecs = _codecs(c)
    params_of = c["params"]
    sg = Subgroup(0, c["base"], c["end"], codecs, params_of.blocks_in(c["base"], c["end"], c["block"]))
    pieces = pieces_of(params_of, c["base"], c["groups"], c["block"])
    gen = torch.Generator().manual_seed(c["seed"])
    master = torch.randn(c["total"], generator=gen) * 0.1
    rem, high = split(master)
    params = (high.clone() if c["remainders"] else master.to(torch.bfloat16)).to(device)
    first = (rem if c["remainders"] else master)[sg.start: sg.end].clone()
    stored = [first.to(device)] + [k.empty(sg.numel, device, blocks=sg.blocks).zero_() for k in codecs[1:]]
    eight = EightBitUpdate(_kernel(device, codecs), codecs, sg.numel, device)
    update = DeviceUpdate(device, codecs, 1 << 20, sg.numel, DeviceKernel(None, eight.how, on_model),
                          eight_bit=eight, largest_blocks=sg.blocks)
    for step in (1, 2):
        grads = (torch.randn(c["total"], generator=gen) * 3e-2).to(c["grad_dtype"]).to(device)
        model = ModelBuffers(PiecedSource(grads, c["grad_cuts"], c["zero"]), PiecedSource(params, c["param_cuts"]))
        update.update(DeviceJob(sg, stored, c["resident"], [], pieces=pieces),
                      copies_io(grads, params, sg, c, HYPERS, step, model if on_model else None))
        if device != "cpu":
            torch.cuda.synchronize()
    return stored, grads, params, eight.model_step(sg, pieces, model)


def _cut_inside_a_block(c) -> bool:
    """Whether a buffer's edge falls inside a block of a param-group piece (the subgroup then goes through copies)."""
    ranges = [(c["base"] + lo, c["base"] + hi) for lo, hi, _, _ in c["groups"]]
    return any(lo < cut < hi and not c["params"].is_block_start(cut, c["block"])
               for cut in c["grad_cuts"] + c["param_cuts"] for lo, hi in ranges)


def _check(c, device):
    want_state, want_grads, want_params, _ = _run(c, False, device)
    got_state, got_grads, got_params, plan = _run(c, True, device)
    for got, want in zip(got_state, want_state):
        assert same_bits(got, want)
    assert same_bits(got_params, want_params)
    assert same_bits(got_grads, want_grads)  # zeroed where read (padding too), untouched outside the subgroup
    assert (plan is None) == _cut_inside_a_block(c)
    if plan is not None:  # every element of a group in exactly one launch, in the group's own hyperparameters
        covered = sorted((L.piece.lo, L.piece.hi, L.piece.g) for L in plan.launches)
        assert sum(hi - lo for lo, hi, _ in covered) == sum(hi - lo for lo, hi, _, _ in c["groups"])
        for lo, hi, g in covered:
            assert any(a <= lo and hi <= b and g == owner for a, b, owner, _ in c["groups"])


@settings(max_examples=examples(200), deadline=None, derandomize=True, print_blob=True)
@given(c=cases())
def test_the_8_bit_update_on_the_model_buffers_leaves_what_the_copies_leave(c):
    _check(c, "cpu")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the Triton kernel needs a CUDA device")
@settings(max_examples=examples(60), deadline=None, derandomize=True, print_blob=True)
@given(c=cases())
def test_on_cuda_the_8_bit_kernel_on_the_model_buffers_leaves_what_the_copies_leave(c):
    _check(c, "cuda")


def test_a_master_stored_in_bf16_goes_through_copies():
    """Only an fp32 master (its param gets the cast) or remainders (the param is its high half) run there."""
    codecs = (codecs_for(("bf16",))[0], Blockwise8("e4m3"), Blockwise8("sqrt-e4m3"))
    kernel = EightBitKernel(blockwise8.adamw_step, "torch path", True, blockwise8.adamw_step_model)
    assert not EightBitUpdate(kernel, codecs, 100, "cpu").on_model
    assert EightBitUpdate(kernel, (codecs_for(("rem16",))[0], *codecs[1:]), 100, "cpu").on_model
    assert not EightBitUpdate(EightBitKernel(blockwise8.adamw_step, "x"), codecs, 100, "cpu").on_model
