"""SdpaAttention (torch's scaled_dot_product_attention) against megatron-core's own unfused
DotProductAttention on random inputs: outputs and gradients, causal and padding masks, GQA,
softmax scale and query-key layer scaling, fp32 and bf16; its dropout draws from the model-parallel
generator; what it cannot do is refused in one line."""

import contextlib
import math
import os

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from megatron.core import parallel_state, tensor_parallel
from megatron.core.fusions import fused_softmax
from megatron.core.transformer import TransformerConfig
from megatron.core.transformer.dot_product_attention import DotProductAttention
from megatron.core.transformer.enums import AttnBackend, AttnMaskType

from tests.profiles import examples

from megatron.training.errors import UserError
from megatron.training.model import kernels
from megatron.training.model.sdpa_attention import SdpaAttention, admitted_cuda_kernels

from . import helpers


# On a GPU machine (benchmarks/experiments/attention.sh) the same comparisons run on the GPU.
DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
GENERATOR = torch.cuda if DEVICE.type == "cuda" else torch  # the default generator of DEVICE


class _ScratchBuffer:
    """megatron-core's global scratch buffer, on DEVICE (it allocates on the current CUDA device)."""

    def get_tensor(self, shape, dtype, name, mem_alloc_context=None):
        return torch.empty(shape, dtype=dtype, device=DEVICE)


class _Tracker:
    """The model-parallel generator as megatron-core's tracker keeps it: ``fork`` swaps DEVICE's
    default generator state for its own and back."""

    def __init__(self, seed: int):
        saved = GENERATOR.get_rng_state()
        GENERATOR.manual_seed(seed)
        self.state = GENERATOR.get_rng_state()
        GENERATOR.set_rng_state(saved)

    @contextlib.contextmanager
    def fork(self, name="model-parallel-rng"):
        outer = GENERATOR.get_rng_state()
        GENERATOR.set_rng_state(self.state)
        try:
            yield
        finally:
            self.state = GENERATOR.get_rng_state()
            GENERATOR.set_rng_state(outer)


@pytest.fixture(scope="module", autouse=True)
def one_process_world():
    yield from helpers.megatron_world_of_one()


@pytest.fixture(autouse=True)
def tracker(monkeypatch):
    monkeypatch.setattr(parallel_state, "get_global_memory_buffer", lambda: _ScratchBuffer())
    # its causal mask is built on the CUDA device: the same mask (True above the diagonal) on DEVICE
    monkeypatch.setattr(fused_softmax, "get_default_causal_mask",
                        lambda sq: torch.ones(sq, sq, dtype=torch.bool, device=DEVICE).triu(1))
    tracker = _Tracker(seed=7)
    monkeypatch.setattr(tensor_parallel, "get_cuda_rng_tracker", lambda: tracker)
    return tracker


def _config(heads, groups, head_dim, dtype=torch.float32, **fields):
    fields.setdefault("attention_dropout", 0.0)
    return TransformerConfig(num_layers=4, hidden_size=heads * head_dim, num_attention_heads=heads,
                             num_query_groups=groups, kv_channels=head_dim,
                             bf16=dtype == torch.bfloat16, params_dtype=dtype, **fields)


def _both(config, mask_type, layer=1, softmax_scale=None):
    ref = DotProductAttention(config, layer, mask_type, "self", softmax_scale=softmax_scale)
    new = SdpaAttention(config, layer, mask_type, "self", softmax_scale=softmax_scale)
    return ref, new


def _output_grad(shape):
    """The gradient of the fixed function of the output: bf16 values, so that the bf16 runs get
    the very gradient the fp32 reference gets."""
    numel = math.prod(shape)
    return torch.linspace(-1, 1, numel).to(torch.bfloat16).float().view(shape).to(DEVICE)


def _run(module, q, k, v, mask):
    """Output and the gradients of a fixed function of it, in fp32."""
    q, k, v = (t.detach().requires_grad_() for t in (q, k, v))
    out = module(q, k, v, mask)
    grads = torch.autograd.grad((out.float() * _output_grad(out.shape)).sum(), (q, k, v))
    return [out.float()] + [g.float() for g in grads]


@st.composite
def cases(draw):
    groups = draw(st.sampled_from([1, 2, 4]))
    heads = groups * draw(st.sampled_from([1, 2, 4]))
    seq = draw(st.integers(1, 40))
    padding = draw(st.booleans())
    return dict(heads=heads, groups=groups, head_dim=draw(st.sampled_from([8, 16, 32])), seq=seq,
                batch=draw(st.integers(1, 3)), padding=padding, layer=draw(st.integers(1, 4)),
                layer_scaling=draw(st.booleans()),
                softmax_scale=draw(st.sampled_from([None, 0.05, 0.3])), seed=draw(st.integers(0, 2**16)))


def _inputs(case, dtype):
    gen = torch.Generator().manual_seed(case["seed"])
    s, b, n, g, d = case["seq"], case["batch"], case["heads"], case["groups"], case["head_dim"]
    q, k, v = (torch.randn(s, b, heads, d, generator=gen).to(DEVICE, dtype) for heads in (n, g, g))
    mask = None
    if case["padding"]:  # True = left out, as megatron-core reads masks; every query keeps itself
        mask = torch.rand(b, 1, s, s, generator=gen) < 0.4
        mask = (mask & ~torch.eye(s, dtype=torch.bool)).to(DEVICE)
    return q, k, v, mask


def _modules(case, dtype):
    config = _config(case["heads"], case["groups"], case["head_dim"], dtype,
                     apply_query_key_layer_scaling=case["layer_scaling"])
    mask_type = AttnMaskType.padding if case["padding"] else AttnMaskType.causal
    return _both(config, mask_type, case["layer"], case["softmax_scale"])


@settings(max_examples=examples(60), deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(cases())
def test_fp32_equals_megatron_cores_unfused_attention(case):
    ref, new = _modules(case, torch.float32)
    q, k, v, mask = _inputs(case, torch.float32)
    for want, got in zip(_run(ref, q, k, v, mask), _run(new, q, k, v, mask)):
        # Same math, other summation orders (fused softmax, GQA without copies): fp32 rounding
        # (~6e-8 per op) over at most 40 keys and 32 channels stays far below 1e-5.
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


U = 2.0**-8  # bf16's unit roundoff: rounding x to bf16 moves it by at most U * |x|


def _magnitudes(case, q, k, v, mask):
    """[out, dq, dk, dv] of the attention and of ``_run``'s gradients computed on absolute values
    (every sum of products a sum of absolute products), in float64, as [s, b, ...] like _run's."""
    s, b, n, g, d = case["seq"], case["batch"], case["heads"], case["groups"], case["head_dim"]
    scale = case["softmax_scale"] or 1 / math.sqrt(d)
    # [b, n, s, d], each group's K and V repeated for its heads
    Q, K, V = (t.double().repeat_interleave(n // t.size(2), dim=2).permute(1, 2, 0, 3) for t in (q, k, v))
    d_out = _output_grad((s, b, n, d)).double().permute(1, 2, 0, 3).abs()
    left_out = mask if mask is not None else torch.ones(s, s, dtype=torch.bool, device=DEVICE).triu(1)
    P = (scale * Q @ K.transpose(-1, -2)).masked_fill(left_out, float("-inf")).softmax(-1)
    Q, K, V = Q.abs(), K.abs(), V.abs()
    out = P @ V
    d_scores = P * (d_out @ V.transpose(-1, -2) + (d_out * out).sum(-1, keepdim=True))  # of P * (dP - D)
    per_group = lambda t: t.unflatten(1, (g, n // g)).sum(2).permute(2, 0, 1, 3)
    return [out.permute(2, 0, 1, 3).reshape(s, b, n * d), (scale * d_scores @ K).permute(2, 0, 1, 3),
            per_group(scale * d_scores.transpose(-1, -2) @ Q), per_group(P.transpose(-1, -2) @ d_out)]


# How many times torch's flash kernels (on CPU; FlashAttention's on CUDA rounds no more) round each
# result's path to bf16. out: the exponentiated scores before they multiply V, the output. dv: those
# scores (recomputed), the result, its sum over query blocks (CPU, blocks of 32), the sum over a
# group's heads (GQA). dq, dk: the output twice, through D = rowsum(d_out * out) that the backward
# takes from the rounded output, dS = P * (dP - D) before it multiplies K or Q, the result; dk also
# the query-block and the group sums.
ROUNDINGS = {"out": 2, "dq": 4, "dk": 6, "dv": 4}


@settings(max_examples=examples(40), deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(cases())
def test_bf16_within_bf16_rounding_of_megatron_cores_unfused_attention(case):
    """SDPA in bf16 against megatron-core's unfused module in fp32, on the same bf16-valued inputs,
    element by element within what SDPA's own bf16 roundings allow: rounding a (partial) sum moves
    it by at most U times the sum of its terms' absolute values, so n roundings on a result's path
    move it by at most gamma(n) = nU / (1 - nU) of its magnitude (_magnitudes). The fp32 reference's
    own rounding, over at most 40 keys and 32 channels, stays below 2^-16 of it.
    The unfused module's error is no bound: it rounds dP after its sum, while SDPA's D comes from the
    rounded output, and dP - D cancels: dq and dk can be off by several bf16 units of their size."""
    _, new = _modules(case, torch.bfloat16)
    exact, _ = _modules(case, torch.float32)
    q, k, v, mask = _inputs(case, torch.bfloat16)
    truth = _run(exact, q.float(), k.float(), v.float(), mask)
    got = _run(new, q, k, v, mask)
    for (name, n), want, result, magnitude in zip(ROUNDINGS.items(), truth, got, _magnitudes(case, q, k, v, mask)):
        bound = (n * U / (1 - n * U) + 2**-16) * magnitude
        excess = ((result.double() - want.double()).abs() - bound).max().item()
        assert excess <= 0, f"{name}: {excess:.3g} beyond the bound of {n} bf16 roundings"


def test_sdpa_is_causal_and_uses_the_given_softmax_scale():
    """A reference written here: position i attends to 0..i only, with the scale given."""
    gen = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(6, 1, 2, 8, generator=gen).to(DEVICE) for _ in range(3))
    _, new = _both(_config(2, 2, 8), AttnMaskType.causal, softmax_scale=0.2)
    scores = torch.einsum("sbnd,tbnd->bnst", q, k) * 0.2
    scores = scores.masked_fill(torch.ones(6, 6, dtype=torch.bool, device=DEVICE).triu(1), float("-inf"))
    want = torch.einsum("bnst,tbnd->sbnd", scores.softmax(-1), v).reshape(6, 1, 16)
    torch.testing.assert_close(new(q, k, v, None), want, rtol=1e-5, atol=1e-6)  # fp32 rounding only


def test_dropout_only_in_training_and_from_the_model_parallel_generator(tracker):
    config = _config(2, 2, 8, attention_dropout=0.5)
    _, new = _both(config, AttnMaskType.causal)
    gen = torch.Generator().manual_seed(5)
    q, k, v = (torch.randn(16, 2, 2, 8, generator=gen).to(DEVICE) for _ in range(3))
    new.eval()
    plain = new(q, k, v, None)
    _, without = _both(_config(2, 2, 8), AttnMaskType.causal)
    assert torch.equal(plain, without(q, k, v, None))
    new.train()
    default_before, tracker_before = GENERATOR.get_rng_state(), tracker.state.clone()
    dropped = new(q, k, v, None)
    assert torch.equal(GENERATOR.get_rng_state(), default_before)  # the default generator is left alone
    assert not torch.equal(tracker.state, tracker_before)
    assert not torch.allclose(dropped, plain)
    # Inverted dropout keeps the expectation: with values all ones every output is 1 on average.
    ones = torch.ones_like(v)
    mean = torch.stack([new(q, k, ones, None) for _ in range(200)]).mean()
    assert abs(mean.item() - 1.0) < 0.05  # 200 x 1024 draws: the mean's spread is well below 0.01


@pytest.mark.parametrize("fields, mask_type, seq_k, words", [
    ({"window_size": (4, 0)}, AttnMaskType.causal, 8, "sliding-window"),
    ({}, AttnMaskType.causal, 5, "causal attention of 8 queries over 5 keys"),
])
def test_what_sdpa_cannot_do_is_refused_in_one_line(fields, mask_type, seq_k, words):
    q = torch.randn(8, 1, 2, 8, device=DEVICE)
    k = torch.randn(seq_k, 1, 2, 8, device=DEVICE)
    with pytest.raises(UserError) as err:
        SdpaAttention(_config(2, 2, 8, **fields), 1, mask_type, "self")(q, k, k, None)
    assert words in str(err.value) and "\n" not in str(err.value)


def test_has_no_parameters_or_buffers_of_its_own():
    ref, new = _both(_config(4, 2, 8), AttnMaskType.causal)
    assert list(new.state_dict()) == list(ref.state_dict()) == []
    assert math.isclose(new.softmax_scale, 1 / math.sqrt(8))


@pytest.fixture
def restored_environment():
    """megatron-core's GPTModel writes its attention backend into NVTE_* variables, which later
    models of this process (and the processes it starts) are checked against."""
    saved = dict(os.environ)
    yield
    os.environ.clear()
    os.environ.update(saved)


def test_checkpoints_of_both_specs_are_interchangeable(restored_environment):
    """The local spec with SDPA has the unfused spec's checkpoint entries (names, shapes, offsets);
    either's parameters load into the other strictly and bit for bit. Also through a decoder block
    spec (what MoE models use)."""
    from types import SimpleNamespace

    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec, get_gpt_layer_local_spec

    from megatron.training.checkpoint.state_dict import sharding_metadata
    from megatron.training.model.attention_spec import with_core_attention

    sdpa = SimpleNamespace(core_attention="sdpa")
    # the backend our training layer gives megatron-core's local layers (model/kernels.py)
    config = _config(4, 2, 8, use_cpu_initialization=True, attention_backend=AttnBackend.local)
    models = {}
    for seed, (name, spec) in enumerate([("unfused", get_gpt_layer_local_spec()),
                                         ("sdpa", with_core_attention(get_gpt_layer_local_spec(), sdpa))]):
        torch.manual_seed(seed)
        models[name] = GPTModel(config, spec, vocab_size=64, max_sequence_length=16)
    cores = {type(layer.self_attention.core_attention) for layer in models["sdpa"].decoder.layers}
    assert cores == {SdpaAttention}
    entries = {name: {key: (t.key, t.global_shape, t.global_offset)
                      for key, t in model.sharded_state_dict(metadata=sharding_metadata()).items()}
               for name, model in models.items()}
    assert entries["sdpa"] == entries["unfused"] and entries["sdpa"]
    for source, target in (("unfused", "sdpa"), ("sdpa", "unfused")):
        torch.manual_seed(7)
        for p in models[target].parameters():
            p.data.normal_()
        models[target].load_state_dict(models[source].state_dict(), strict=True)
        for (name, got), (_, want) in zip(models[target].named_parameters(), models[source].named_parameters()):
            assert torch.equal(got, want), name
    block = with_core_attention(get_gpt_decoder_block_spec(config, use_transformer_engine=False), sdpa)
    assert {s.submodules.self_attention.submodules.core_attention for s in block.layer_specs} == {SdpaAttention}


def test_start_up_line_names_the_kernels_torch_admits_on_a_gpu():
    """torch's own checks answer for the model's shapes (on a CPU tensor none of its CUDA kernels
    admits it; on a GPU, flash admits bf16 GQA with head dim 16); the line says what runs for each answer."""
    from types import SimpleNamespace

    admitted = admitted_cuda_kernels(_config(4, 2, 16, torch.bfloat16), DEVICE)
    assert "flash" in admitted if DEVICE.type == "cuda" else admitted == []
    args = SimpleNamespace(core_attention="sdpa")
    assert "math kernel" in kernels.attention_line(args, [])
    assert "its flash, cuDNN kernel(s)" in kernels.attention_line(args, ["flash", "cuDNN"])
    assert "on CPU its flash kernel" in kernels.attention_line(args)
