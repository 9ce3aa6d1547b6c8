"""The FLOPs count behind 'throughput per GPU (TFLOP/s/GPU)', against a reference written the
other way Megatron-LM writes it (its hybrid-model helpers: per-layer forward FLOPs, times three)."""

from types import SimpleNamespace

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.profiles import examples

from megatron.training.model.flops import GptShape, flops_per_iteration, tflops_per_gpu


def _reference(batch, seq, hidden, layers, heads, groups, ffn, swiglu, vocab):
    tokens = batch * seq
    attention = 4 * tokens * hidden * (hidden + hidden * groups / heads + seq / 2)
    mlp = 4 * (ffn / hidden) * (1.5 if swiglu else 1.0) * tokens * hidden ** 2
    logits = 2 * tokens * hidden * vocab
    return 3 * (layers * (attention + mlp) + logits)


@pytest.mark.parametrize("heads,groups,ffn,swiglu", [
    (32, 32, 4 * 4096, False),  # GPT-style MHA with GeLU
    (32, 8, 14336, True),  # Llama-3-8B-style GQA with SwiGLU
    (4, 1, 192, True),  # multi-query attention
])
def test_matches_the_reference_form(heads, groups, ffn, swiglu):
    hidden = 4096 if heads == 32 else 64
    config = SimpleNamespace(num_layers=7, hidden_size=hidden, ffn_hidden_size=ffn, num_attention_heads=heads,
                             num_query_groups=groups, kv_channels=None, gated_linear_unit=swiglu)
    shape = GptShape.from_config(config, seq_length=2048, vocab_size=128256)
    expected = _reference(16, 2048, hidden, 7, heads, groups, ffn, swiglu, 128256)
    assert flops_per_iteration(shape, 16) == pytest.approx(expected, rel=1e-12)  # the same terms, grouped otherwise


def test_no_query_groups_means_one_per_head():
    common = dict(num_layers=2, hidden_size=64, ffn_hidden_size=256, num_attention_heads=4, kv_channels=None,
                  gated_linear_unit=False)
    mha = GptShape.from_config(SimpleNamespace(num_query_groups=None, **common), 64, 512)
    explicit = GptShape.from_config(SimpleNamespace(num_query_groups=4, **common), 64, 512)
    assert flops_per_iteration(mha, 8) == flops_per_iteration(explicit, 8)


def test_tflops_per_gpu_divides_by_time_and_ranks():
    assert tflops_per_gpu(8e12, 2.0, 4) == pytest.approx(1.0)  # approx: divisions by 1e12 in float


def _moe_reference(batch, seq, hidden, heads, groups, ffn, swiglu, vocab, pattern, moe_ffn, topk, shared):
    """Megatron-LM's hybrid-model form: per-layer forward FLOPs (attention, dense MLP, MoE MLP of
    top-k routed experts plus shared experts) summed over the layer pattern, logits, times three."""
    tokens = batch * seq
    scale = 1.5 if swiglu else 1.0
    attention = 4 * tokens * hidden * (hidden + hidden * groups / heads + seq / 2)
    mlp = 4 * (ffn / hidden) * scale * tokens * hidden ** 2
    moe = 4 * tokens * hidden * moe_ffn * topk * scale + 4 * tokens * hidden * shared * scale
    layers = len(pattern)
    return 3 * (layers * attention + (layers - sum(pattern)) * mlp + sum(pattern) * moe + 2 * tokens * hidden * vocab)


@st.composite
def moe_configs(draw):
    heads = draw(st.sampled_from([2, 4, 8]))
    layers = draw(st.integers(1, 6))
    experts = draw(st.integers(1, 64))
    pattern = draw(st.lists(st.sampled_from([0, 1]), min_size=layers, max_size=layers))
    freq = draw(st.sampled_from([pattern, 1, 2, 3]))
    config = SimpleNamespace(
        num_layers=layers, hidden_size=heads * draw(st.sampled_from([16, 64])),
        ffn_hidden_size=draw(st.integers(8, 4096)), num_attention_heads=heads,
        num_query_groups=draw(st.sampled_from([g for g in (1, 2, heads) if heads % g == 0])), kv_channels=None,
        gated_linear_unit=draw(st.booleans()), num_moe_experts=experts, moe_layer_freq=freq,
        moe_ffn_hidden_size=draw(st.integers(8, 2048)), moe_router_topk=draw(st.integers(1, experts)),
        moe_shared_expert_intermediate_size=draw(st.sampled_from([None, 256, 1000])))
    return config, draw(st.integers(16, 4096)), draw(st.integers(128, 200000)), draw(st.integers(1, 64))


@settings(max_examples=examples(100), deadline=None)
@given(moe_configs())
def test_moe_matches_the_reference_form(drawn):
    config, seq, vocab, batch = drawn
    pattern = config.moe_layer_freq if isinstance(config.moe_layer_freq, list) else [
        int(i % config.moe_layer_freq == 0) for i in range(config.num_layers)]
    expected = _moe_reference(batch, seq, config.hidden_size, config.num_attention_heads, config.num_query_groups,
                              config.ffn_hidden_size, config.gated_linear_unit, vocab, pattern,
                              config.moe_ffn_hidden_size, config.moe_router_topk,
                              config.moe_shared_expert_intermediate_size or 0)
    shape = GptShape.from_config(config, seq_length=seq, vocab_size=vocab)
    assert flops_per_iteration(shape, batch) == pytest.approx(expected, rel=1e-12)  # the same terms, grouped otherwise


def test_one_expert_of_the_dense_width_costs_a_dense_layer():
    """Top-1 of any number of experts as wide as the dense MLP: the dense model's FLOPs."""
    common = dict(num_layers=4, hidden_size=64, ffn_hidden_size=256, num_attention_heads=4, num_query_groups=None,
                  kv_channels=None, gated_linear_unit=True)
    moe = SimpleNamespace(num_moe_experts=16, moe_layer_freq=2, moe_ffn_hidden_size=256, moe_router_topk=1,
                          moe_shared_expert_intermediate_size=None, **common)
    assert flops_per_iteration(GptShape.from_config(moe, 128, 512), 8) == flops_per_iteration(
        GptShape.from_config(SimpleNamespace(**common), 128, 512), 8)


def _mla_reference(batch, seq, hidden, layers, heads, q_lora, kv_lora, qk, pos, v, dense_ffn, vocab):
    """Megatron-LM's num_floating_point_operations for multi-latent attention, written as upstream
    writes it: token-linear terms times batch x seq, the core-attention term times batch x seq^2,
    with 3 passes x 2 FLOPs per multiply-add; a dense GeLU MLP and the logits around it."""
    q_term = hidden * heads * (qk + pos) if q_lora is None else q_lora * (hidden + heads * (qk + pos) + 1)
    linear = 3 * 2 * (q_term + kv_lora * (hidden + heads * (qk + v) + 1) + hidden * pos + heads * v * hidden)
    core = 3 * 2 * (heads * (qk + pos) / 2 + heads * v / 2)
    tokens = batch * seq
    attention = linear * tokens + core * batch * seq * seq
    mlp = 3 * 2 * 2 * hidden * dense_ffn * tokens
    return layers * (attention + mlp) + 3 * 2 * hidden * vocab * tokens


@settings(max_examples=examples(50), deadline=None)
@given(heads=st.sampled_from([1, 16, 128]), q_lora=st.sampled_from([None, 24, 1536]),
       kv_lora=st.sampled_from([16, 512]), qk=st.sampled_from([16, 128]), pos=st.sampled_from([8, 64]),
       v=st.sampled_from([16, 128]), seq=st.sampled_from([32, 4096]), batch=st.integers(1, 64))
def test_mla_matches_megatron_lm_form(heads, q_lora, kv_lora, qk, pos, v, seq, batch):
    config = SimpleNamespace(num_layers=3, hidden_size=2048, ffn_hidden_size=8192, num_attention_heads=heads,
                             num_query_groups=None, kv_channels=16, gated_linear_unit=False,
                             multi_latent_attention=True, q_lora_rank=q_lora, kv_lora_rank=kv_lora, qk_head_dim=qk,
                             qk_pos_emb_head_dim=pos, v_head_dim=v)
    shape = GptShape.from_config(config, seq_length=seq, vocab_size=102400)
    expected = _mla_reference(batch, seq, 2048, 3, heads, q_lora, kv_lora, qk, pos, v, 8192, 102400)
    # the two sum the same terms in another order: floats, not bit-identical
    assert flops_per_iteration(shape, batch) == pytest.approx(expected, rel=1e-12)
