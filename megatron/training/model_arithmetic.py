"""Sizes Megatron-LM derives from its flags, so the same flags build the same network.

Pure functions: ``arguments_megatron`` fills the defaults with them, the model is built from the
results, and the tests compare them against Megatron-LM's arithmetic written out independently.
"""

from __future__ import annotations

FFN_MULTIPLE = 64  # Megatron-LM keeps the SwiGLU FFN a multiple of 64, so each TP shard is 64/TP-aligned


def default_ffn_hidden_size(hidden_size: int, swiglu: bool) -> int:
    """4h; with SwiGLU two thirds of it (two input projections keep ~8h^2 weights), rounded DOWN
    to a multiple of 64, as Megatron-LM does (hidden 4096 -> 10880)."""
    if not swiglu:
        return 4 * hidden_size
    return int((4 * hidden_size * 2 / 3) / FFN_MULTIPLE) * FFN_MULTIPLE


def default_kv_channels(hidden_size: int, num_attention_heads: int) -> int:
    """The per-head size when --kv-channels is not given."""
    return hidden_size // num_attention_heads


def vocab_size_with_padding(vocab_size: int, divisible_by: int, tensor_parallel_size: int) -> int:
    """The tokenizer's size rounded up to a multiple of divisible_by x TP, so every TP shard of the
    embedding holds the same number of rows."""
    multiple = divisible_by * tensor_parallel_size
    return -(-vocab_size // multiple) * multiple
