"""Model FLOPs of one training iteration, counted as Megatron-LM counts them for its
'throughput per GPU (TFLOP/s/GPU)' figure: matrix multiplies only (norms, softmax and
element-wise ops are left out), three passes per GEMM (forward, weight grad, data grad),
a causal mask halving the attention scores, and the output layer's logits. A mixture-of-experts
layer counts top-k routed experts of ``--moe-ffn-hidden-size`` plus its shared experts per token
(the router's own small GEMM is left out, as upstream leaves it).

The shape comes from megatron-core's ``TransformerConfig`` as training builds it, so defaults
(FFN size, KV channels, query groups) are the ones the model really has.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from megatron.training.model.moe import moe_layers

# Each GEMM runs three times per iteration: forward, backward for the input, backward for the weight.
PASSES_PER_ITERATION = 3
# An m x n by n x k product is m*n*k multiply-adds, two floating-point operations each.
FLOPS_PER_MULTIPLY_ADD = 2


@dataclass(frozen=True)
class MlaShape:
    q_lora_rank: int  # 0: the queries in one projection
    kv_lora_rank: int
    qk_head_dim: int
    qk_pos_emb_head_dim: int
    v_head_dim: int


@dataclass(frozen=True)
class GptShape:
    num_layers: int
    hidden_size: int
    ffn_hidden_size: int
    num_attention_heads: int
    num_query_groups: int  # == num_attention_heads without GQA
    kv_channels: int  # per-head width
    gated_mlp: bool  # SwiGLU: the first MLP GEMM produces two ffn-wide halves
    seq_length: int
    vocab_size: int  # the padded one: the output layer's real width
    num_moe_layers: int = 0  # of num_layers; the others have a dense MLP of ffn_hidden_size
    moe_ffn_hidden_size: int = 0
    moe_router_topk: int = 0
    shared_expert_ffn_hidden_size: int = 0
    mla: Optional["MlaShape"] = None  # multi-latent attention's widths, in place of the QKV ones

    @classmethod
    def from_config(cls, config, seq_length: int, vocab_size: int) -> "GptShape":
        heads = config.num_attention_heads
        moe = {}
        if getattr(config, "num_moe_experts", None):
            moe = dict(num_moe_layers=sum(moe_layers(config.num_layers, config.moe_layer_freq)),
                       moe_ffn_hidden_size=config.moe_ffn_hidden_size, moe_router_topk=config.moe_router_topk,
                       shared_expert_ffn_hidden_size=config.moe_shared_expert_intermediate_size or 0)
        if getattr(config, "multi_latent_attention", False):
            moe["mla"] = MlaShape(config.q_lora_rank or 0, config.kv_lora_rank, config.qk_head_dim,
                                  config.qk_pos_emb_head_dim, config.v_head_dim)
        return cls(num_layers=config.num_layers, hidden_size=config.hidden_size,
                   ffn_hidden_size=config.ffn_hidden_size, num_attention_heads=heads,
                   num_query_groups=config.num_query_groups or heads,
                   kv_channels=config.kv_channels or config.hidden_size // heads,
                   gated_mlp=bool(config.gated_linear_unit), seq_length=seq_length, vocab_size=vocab_size, **moe)


def multiply_adds_per_token(shape: GptShape) -> float:
    """Multiply-adds of one token's forward pass, summed over the layers and the logits."""
    h, s = shape.hidden_size, shape.seq_length
    query_width = shape.kv_channels * shape.num_attention_heads
    key_value_width = shape.kv_channels * shape.num_query_groups  # shared by the heads of a group (GQA)
    qkv_projection = h * (query_width + 2 * key_value_width)
    # Scores (Q K^T) and their weighted sum (softmax V): each s wide per token, half under a causal mask.
    core_attention = 2 * query_width * s / 2
    output_projection = query_width * h
    mlp_matrices = 3 if shape.gated_mlp else 2  # gate and up (SwiGLU) or up, then down
    attention = qkv_projection + core_attention + output_projection
    if shape.mla is not None:
        attention = mla_multiply_adds_per_token(shape.mla, h, shape.num_attention_heads, s)
    dense_mlp = h * shape.ffn_hidden_size * mlp_matrices
    # A token goes through top-k routed experts and every shared expert (one MLP of their summed width).
    moe_mlp = h * mlp_matrices * (shape.moe_router_topk * shape.moe_ffn_hidden_size
                                  + shape.shared_expert_ffn_hidden_size)
    mlps = (shape.num_layers - shape.num_moe_layers) * dense_mlp + shape.num_moe_layers * moe_mlp
    logits = h * shape.vocab_size
    return shape.num_layers * attention + mlps + logits


def mla_multiply_adds_per_token(mla: MlaShape, h: int, heads: int, s: int) -> float:
    """One multi-latent attention layer, as Megatron-LM counts it: the low-rank projections (each
    latent's norm counted as one more column, as upstream does), the shared RoPE key, the output
    projection, and the scores over qk + pos wide heads and the weighted sum over v wide ones,
    halved by the causal mask."""
    q_head = mla.qk_head_dim + mla.qk_pos_emb_head_dim
    if mla.q_lora_rank:
        query = mla.q_lora_rank * (h + heads * q_head + 1)
    else:
        query = h * heads * q_head
    key_value = mla.kv_lora_rank * (h + heads * (mla.qk_head_dim + mla.v_head_dim) + 1) + h * mla.qk_pos_emb_head_dim
    output_projection = heads * mla.v_head_dim * h
    core_attention = (heads * q_head + heads * mla.v_head_dim) * s / 2
    return query + key_value + output_projection + core_attention


def flops_per_iteration(shape: GptShape, global_batch_size: int) -> float:
    tokens = global_batch_size * shape.seq_length
    return PASSES_PER_ITERATION * FLOPS_PER_MULTIPLY_ADD * multiply_adds_per_token(shape) * tokens


def tflops_per_gpu(flops: float, seconds_per_iteration: float, world_size: int) -> float:
    """Megatron-LM's throughput figure: the iteration's model FLOPs over its time, per rank."""
    return flops / (seconds_per_iteration * 1e12 * world_size)
