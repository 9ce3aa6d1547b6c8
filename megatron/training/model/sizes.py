"""How many parameters a GPT built from ``pretrain_gpt.py``'s flags holds on each model-parallel rank.

Counted from the same ``TransformerConfig`` the training builds (``training.transformer_config``),
so FFN size, KV channels and query groups follow the flags exactly as the model does. The layout
is megatron-core's GPTModel: word embeddings (and learned positions) on the first pipeline stage;
the final norm and the output layer on the last, which keeps its own copy of tied embeddings when
it is not also the first; tensor parallelism splits the linear layers and the vocabulary, while
norms, positions and the row-parallel biases are replicated.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import List


@dataclass(frozen=True)
class StageParams:
    """Parameters held by one tensor-parallel rank of one pipeline stage."""

    stage: int
    layers: int
    params: int


def _layer_params(cfg, tp: int) -> int:
    h = cfg.hidden_size
    q = cfg.num_attention_heads * cfg.kv_channels
    kv = (cfg.num_query_groups or cfg.num_attention_heads) * cfg.kv_channels
    ffn_out = cfg.ffn_hidden_size * (2 if cfg.gated_linear_unit else 1)
    norm = h * (2 if cfg.normalization == "LayerNorm" else 1)
    bias = cfg.add_bias_linear
    qkv = h * (q + 2 * kv) // tp + ((q + 2 * kv) // tp if bias or cfg.add_qkv_bias else 0)
    proj = q // tp * h + (h if bias else 0)  # row-parallel: its bias is whole on every rank
    fc1 = h * ffn_out // tp + (ffn_out // tp if bias else 0)
    fc2 = cfg.ffn_hidden_size // tp * h + (h if bias else 0)
    return 2 * norm + qkv + proj + fc1 + fc2


def stage_params(cfg, vocab_size: int, max_positions: int, position_embedding: str,
                 tied_embeddings: bool) -> List[StageParams]:
    """Parameters on one tensor-parallel rank of each pipeline stage (``vocab_size`` padded)."""
    tp, pp = cfg.tensor_model_parallel_size, cfg.pipeline_model_parallel_size
    h = cfg.hidden_size
    layers = cfg.num_layers // pp
    stages = []
    for stage in range(pp):
        count = layers * _layer_params(cfg, tp)
        if stage == 0:
            count += vocab_size // tp * h
            if position_embedding == "learned_absolute":
                count += max_positions * h
        if stage == pp - 1:
            count += h * (2 if cfg.normalization == "LayerNorm" else 1)
            if not tied_embeddings or pp > 1:
                count += vocab_size // tp * h
        stages.append(StageParams(stage, layers, count))
    return stages


def model_params(stages: List[StageParams], tp: int) -> int:
    """One replica of the whole model (every stage, every tensor-parallel rank), as the training
    log counts it (a tied output layer's copy on the last stage included)."""
    return sum(s.params for s in stages) * tp
