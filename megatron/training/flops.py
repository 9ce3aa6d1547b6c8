"""Floating-point operations of one training iteration of a GPT, counted as Megatron-LM counts them
for its TFLOP/s figure: every matrix multiply at 2 FLOPs per multiply-add, the backward pass at twice
the forward, attention scores over the whole sequence (causal masking not discounted), the logits
once per token. Norms, softmax and element-wise work are left out, as there.
"""

from __future__ import annotations


def forward_flops_per_token(cfg, vocab_size: int, seq_length: int) -> float:
    """One token's forward pass through every layer and the output layer."""
    h = cfg.hidden_size
    q = cfg.num_attention_heads * cfg.kv_channels
    kv = (cfg.num_query_groups or cfg.num_attention_heads) * cfg.kv_channels
    ffn_width = cfg.ffn_hidden_size * (2 if cfg.gated_linear_unit else 1)
    per_layer = (
        2 * h * (q + 2 * kv)  # query, key and value projections
        + 2 * 2 * seq_length * q  # scores (Q K^T) and their weighting of V, over the whole sequence
        + 2 * q * h  # output projection
        + 2 * h * ffn_width + 2 * cfg.ffn_hidden_size * h  # MLP up (gate) and down
    )
    return cfg.num_layers * per_layer + 2 * h * vocab_size


def iteration_flops(cfg, vocab_size: int, seq_length: int, global_batch_size: int) -> float:
    """Forward and backward (twice the forward) over the global batch; full activation recompute
    adds another forward, which Megatron-LM's figure does not count either."""
    return 3 * forward_flops_per_token(cfg, vocab_size, seq_length) * seq_length * global_batch_size
