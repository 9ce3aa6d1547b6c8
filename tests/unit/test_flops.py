"""The FLOPs count behind 'throughput per GPU (TFLOP/s/GPU)', against a reference written the
other way Megatron-LM writes it (its hybrid-model helpers: per-layer forward FLOPs, times three)."""

from types import SimpleNamespace

import pytest

from megatron.training.model.flops import DenseGptShape, flops_per_iteration, tflops_per_gpu


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
    shape = DenseGptShape.from_config(config, seq_length=2048, vocab_size=128256)
    expected = _reference(16, 2048, hidden, 7, heads, groups, ffn, swiglu, 128256)
    assert flops_per_iteration(shape, 16) == pytest.approx(expected, rel=1e-12)


def test_no_query_groups_means_one_per_head():
    common = dict(num_layers=2, hidden_size=64, ffn_hidden_size=256, num_attention_heads=4, kv_channels=None,
                  gated_linear_unit=False)
    mha = DenseGptShape.from_config(SimpleNamespace(num_query_groups=None, **common), 64, 512)
    explicit = DenseGptShape.from_config(SimpleNamespace(num_query_groups=4, **common), 64, 512)
    assert flops_per_iteration(mha, 8) == flops_per_iteration(explicit, 8)


def test_tflops_per_gpu_divides_by_time_and_ranks():
    assert tflops_per_gpu(8e12, 2.0, 4) == pytest.approx(1.0)
