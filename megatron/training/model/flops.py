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

from megatron.training.model.moe import moe_layers

# Each GEMM runs three times per iteration: forward, backward for the input, backward for the weight.
PASSES_PER_ITERATION = 3
# An m x n by n x k product is m*n*k multiply-adds, two floating-point operations each.
FLOPS_PER_MULTIPLY_ADD = 2


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

    @classmethod
    def from_config(cls, config, seq_length: int, vocab_size: int) -> "GptShape":
        heads = config.num_attention_heads
        moe = {}
        if getattr(config, "num_moe_experts", None):
            moe = dict(num_moe_layers=sum(moe_layers(config.num_layers, config.moe_layer_freq)),
                       moe_ffn_hidden_size=config.moe_ffn_hidden_size, moe_router_topk=config.moe_router_topk,
                       shared_expert_ffn_hidden_size=config.moe_shared_expert_intermediate_size or 0)
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
    dense_mlp = h * shape.ffn_hidden_size * mlp_matrices
    # A token goes through top-k routed experts and every shared expert (one MLP of their summed width).
    moe_mlp = h * mlp_matrices * (shape.moe_router_topk * shape.moe_ffn_hidden_size
                                  + shape.shared_expert_ffn_hidden_size)
    mlps = (shape.num_layers - shape.num_moe_layers) * dense_mlp + shape.num_moe_layers * moe_mlp
    logits = h * shape.vocab_size
    return shape.num_layers * attention + mlps + logits


def flops_per_iteration(shape: GptShape, global_batch_size: int) -> float:
    tokens = global_batch_size * shape.seq_length
    return PASSES_PER_ITERATION * FLOPS_PER_MULTIPLY_ADD * multiply_adds_per_token(shape) * tokens


def tflops_per_gpu(flops: float, seconds_per_iteration: float, world_size: int) -> float:
    """Megatron-LM's throughput figure: the iteration's model FLOPs over its time, per rank."""
    return flops / (seconds_per_iteration * 1e12 * world_size)
