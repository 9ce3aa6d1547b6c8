"""The local core attention for multi-latent attention (model/mla_attention.py) against softmax
attention written in torch: keys wider than values, MLA's own softmax scale, a causal mask."""

import contextlib
import math
from unittest import mock

import pytest
import torch

from tests.unit.helpers import megatron_world_of_one
from megatron.training.model.mla_attention import MLADotProductAttention, local_mla_spec


@pytest.fixture(scope="module", autouse=True)
def one_process_world():
    yield from megatron_world_of_one()


def _reference(query, key, value, scale):
    """[s, b, heads, width] in; [s, b, heads * v width] out: causal softmax(q k^T * scale) v."""
    s = query.shape[0]
    scores = torch.einsum("sbhd,tbhd->bhst", query, key) * scale
    scores = scores.masked_fill(torch.ones(s, s, dtype=torch.bool).triu(1), float("-inf"))
    out = torch.einsum("bhst,tbhd->sbhd", scores.softmax(-1), value)
    return out.reshape(s, query.shape[1], -1)


@pytest.mark.parametrize("heads, qk_width, v_width", [(2, 10, 6), (4, 24, 16), (1, 8, 8)])
def test_matches_softmax_attention_with_wider_keys(heads, qk_width, v_width):
    from megatron.core import tensor_parallel
    from megatron.core.transformer import MLATransformerConfig
    from megatron.core.transformer.enums import AttnMaskType

    config = MLATransformerConfig(num_layers=1, hidden_size=32, num_attention_heads=heads, attention_dropout=0.0,
                                  qk_head_dim=qk_width - 2, qk_pos_emb_head_dim=2, v_head_dim=v_width,
                                  masked_softmax_fusion=False)
    scale = 0.37  # MLA passes its own (YaRN's mscale over sqrt(qk width)); any value must be the one used
    attention = MLADotProductAttention(config, 1, AttnMaskType.causal, "self", softmax_scale=scale,
                                       k_channels=qk_width, v_channels=v_width)
    generator = torch.Generator().manual_seed(heads)
    s, b = 7, 3
    query, key = (torch.randn(s, b, heads, qk_width, generator=generator) for _ in range(2))
    value = torch.randn(s, b, heads, v_width, generator=generator)
    causal = torch.ones(1, 1, s, s, dtype=torch.bool).triu(1)  # True: masked, as megatron-core's masks
    # megatron-core takes its score buffer on torch.cuda.current_device() (cpu_compat answers it in a
    # run) and forks its CUDA RNG tracker around the dropout (none here: attention_dropout 0).
    tracker = tensor_parallel.get_cuda_rng_tracker()
    with mock.patch("torch.cuda.current_device", return_value=torch.device("cpu")), \
            mock.patch.object(tracker, "fork", contextlib.nullcontext):
        got = attention(query, key, value, causal, attn_mask_type=AttnMaskType.causal)
    # the same products summed in another order (baddbmm vs einsum): fp32 rounding, not bit-identity
    torch.testing.assert_close(got, _reference(query, key, value, scale), rtol=1e-5, atol=1e-6)
    assert scale != 1 / math.sqrt(qk_width)


def test_spec_swaps_only_the_core_attention_of_mla_layers():
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.dot_product_attention import DotProductAttention

    mla = local_mla_spec(get_gpt_layer_local_spec(multi_latent_attention=True))
    assert mla.submodules.self_attention.submodules.core_attention is MLADotProductAttention
    plain = local_mla_spec(get_gpt_layer_local_spec())
    assert plain.submodules.self_attention.submodules.core_attention is DotProductAttention
