"""Core attention through torch's ``scaled_dot_product_attention`` (SDPA).

A drop-in for megatron-core's unfused ``DotProductAttention`` in the local layer spec: the same
constructor and ``forward(query, key, value, attention_mask, ...)`` on ``[s, b, heads, head_dim]``,
the same result up to rounding, and no parameters of its own, so checkpoints of the two specs are
interchangeable. The unfused module materialises the ``[b, heads, sq, sk]`` score matrix; SDPA
dispatches to torch's flash, memory-efficient or cuDNN kernels on CUDA (on CPU to its flash kernel
without dropout), whose memory grows linearly with the sequence.
"""

from __future__ import annotations

import contextlib
import math
from typing import List, Optional

import torch
import torch.nn.functional as F
from megatron.core import tensor_parallel
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.transformer_config import TransformerConfig
from megatron.core.transformer.utils import is_layer_window_attention

from megatron.training.errors import UserError
from megatron.training.runtime import determinism

UNUSED_ARGUMENTS = {"cp_comm_type", "pg_collection"}
_WHY = "torch's scaled_dot_product_attention (--attention-backend flash|auto without transformer-engine)"


class SdpaAttention(MegatronModule):
    """megatron-core's core-attention interface computed by ``F.scaled_dot_product_attention``."""

    def __init__(self, config: TransformerConfig, layer_number: int, attn_mask_type: AttnMaskType,
                 attention_type: str, attention_dropout: Optional[float] = None,
                 softmax_scale: Optional[float] = None, **unused):
        """``unused``: the core-attention arguments megatron-core also passes (``UNUSED_ARGUMENTS``) that
        this module has no use for (no context parallelism; no process groups of its own)."""
        unknown = sorted(set(unused) - UNUSED_ARGUMENTS)
        if unknown:
            raise TypeError(f"SdpaAttention got unexpected argument(s) {unknown}")
        super().__init__(config=config)
        _refuse_unsupported(config, layer_number)
        self.attn_mask_type = attn_mask_type
        # The unfused module divides its score scale by the layer number under
        # apply_query_key_layer_scaling and multiplies it back inside its fp32 softmax (to keep fp16
        # scores from overflowing): the net scale is this one. SDPA's kernels accumulate in fp32.
        self.softmax_scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(config.kv_channels)
        self.dropout_p = config.attention_dropout if attention_dropout is None else attention_dropout

    def forward(self, query, key, value, attention_mask, attn_mask_type=None, attention_bias=None,
                packed_seq_params=None):
        if attention_bias is not None or packed_seq_params is not None:
            raise UserError(f"attention bias and packed sequences are not supported by {_WHY}")
        sq, b, heads, _ = query.shape
        sk, kv_heads = key.size(0), key.size(2)
        mask, causal = self._mask(attention_mask, sq, sk)
        # [s, b, n, d] -> [b, n, s, d], SDPA's layout
        q, k, v = (t.permute(1, 2, 0, 3) for t in (query, key, value))
        dropout_p = self.dropout_p if self.training else 0.0
        with self._dropout_rng(dropout_p), determinism.sdpa_backends(self.config.deterministic_mode):
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=dropout_p, is_causal=causal,
                                                 scale=self.softmax_scale, enable_gqa=kv_heads != heads)
        # [b, n, sq, d_v] -> [sq, b, n * d_v]
        return out.permute(2, 0, 1, 3).reshape(sq, b, heads * out.size(-1))

    def _mask(self, attention_mask, sq: int, sk: int):
        """SDPA's (attn_mask, is_causal) for megatron-core's mask: a given boolean mask marks the
        positions to leave out (True), as the unfused module reads it; without one a causal layer
        masks the future, except for one query (a decoding step sees every cached key)."""
        if attention_mask is not None:
            if attention_mask.dtype != torch.bool:
                raise UserError(f"attention mask of dtype {attention_mask.dtype}: {_WHY} takes boolean masks")
            return ~attention_mask, False
        if self.attn_mask_type != AttnMaskType.causal or sq == 1:
            return None, False
        if sq != sk:
            raise UserError(f"causal attention of {sq} queries over {sk} keys is not supported by {_WHY}")
        return None, True

    def _dropout_rng(self, dropout_p: float):
        """The model-parallel generator, as megatron-core's unfused attention draws its dropout
        (under sequence parallelism, the default generator)."""
        if dropout_p == 0.0 or self.config.sequence_parallel:
            return contextlib.nullcontext()
        return tensor_parallel.get_cuda_rng_tracker().fork()


def _refuse_unsupported(config: TransformerConfig, layer_number: int) -> None:
    if config.context_parallel_size > 1:
        raise UserError(f"--context-parallel-size {config.context_parallel_size}: not supported by {_WHY}")
    if is_layer_window_attention(config.window_size, config.window_attn_skip_freq, layer_number):
        raise UserError(f"sliding-window attention (window {config.window_size}) is not supported by {_WHY}")
    if config.softmax_type != "vanilla":
        raise UserError(f"softmax type {config.softmax_type} is not supported by {_WHY}")


def admitted_cuda_kernels(config: TransformerConfig, device) -> List[str]:
    """torch's fused SDPA kernels that admit this model's attention (its dtype, heads, groups, head
    dim, dropout, causal) on ``device``: torch picks among them per call, and falls back to its math
    kernel, which materialises the score matrix, where none does. Asked of torch's own checks."""
    from torch.backends import cuda as backends

    dtype = config.params_dtype
    heads, groups = config.num_attention_heads, config.num_query_groups or config.num_attention_heads
    q = torch.empty(1, heads, 128, config.kv_channels, dtype=dtype, device=device)
    kv = torch.empty(1, groups, 128, config.kv_channels, dtype=dtype, device=device)
    params = backends.SDPAParams(q, kv, kv, None, config.attention_dropout, True, groups != heads)
    checks = (("flash", "can_use_flash_attention"), ("memory-efficient", "can_use_efficient_attention"),
              ("cuDNN", "can_use_cudnn_attention"))
    if config.deterministic_mode:  # determinism.sdpa_backends leaves cuDNN's out
        checks = checks[:2]
    return [name for name, check in checks if hasattr(backends, check) and getattr(backends, check)(params, False)]
