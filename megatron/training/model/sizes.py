"""Sizes of the model: what Megatron-LM derives from its flags, how many parameters a GPT built from
``pretrain_gpt.py``'s flags holds on each model-parallel rank, and the parameters' L2 norm.

The derived sizes are pure functions (``args.megatron`` fills the defaults with them, the model is
built from the results; the tests compare them against Megatron-LM's arithmetic written out).
The parameter counts come from the same ``TransformerConfig`` the training builds
(``model.configs.transformer_config``), so FFN size, KV channels and query groups follow the flags
exactly as the model does. The layout
is megatron-core's GPTModel: word embeddings (and learned positions) on the first pipeline stage;
the final norm and the output layer on the last, which keeps its own copy of tied embeddings when
it is not also the first; tensor parallelism splits the linear layers and the vocabulary, while
norms, positions and the row-parallel biases are replicated.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import List

import torch
from megatron.core import parallel_state
from megatron.core.tensor_parallel.layers import param_is_not_tensor_parallel_duplicate
from megatron.core.transformer.module import param_is_not_shared

from megatron.training.model.layer_params import expert_params, layer_params, layers_of_stage, moe_pattern
from megatron.training.runtime.progress import model_device

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


@dataclass(frozen=True)
class StageParams:
    """Parameters held by one rank of one pipeline stage: ``dense`` on each tensor-parallel rank,
    ``experts`` (routed experts) on each expert-parallel x expert-tensor-parallel rank."""

    stage: int
    layers: int
    dense: int
    experts: int = 0

    @property
    def params(self) -> int:
        return self.dense + self.experts


def stage_params(cfg, vocab_size: int, max_positions: int, position_embedding: str,
                 tied_embeddings: bool) -> List[StageParams]:
    """Parameters on one rank of each pipeline stage (``vocab_size`` padded)."""
    tp, pp = cfg.tensor_model_parallel_size, cfg.pipeline_model_parallel_size
    h = cfg.hidden_size
    pattern = moe_pattern(cfg)
    stages = []
    for stage in range(pp):
        layers = [layer_params(cfg, bool(pattern[i])) for i in layers_of_stage(cfg, stage)]
        dense, experts = sum(p.dense for p in layers), sum(p.experts for p in layers)
        if stage == 0:
            dense += vocab_size // tp * h
            if position_embedding == "learned_absolute":
                dense += max_positions * h
        if stage == pp - 1:
            dense += h * (2 if cfg.normalization == "LayerNorm" else 1)
            if not tied_embeddings or pp > 1:
                dense += vocab_size // tp * h
        stages.append(StageParams(stage, len(layers), dense, experts))
    return stages


def model_params(stages: List[StageParams], tp: int, expert_ranks: int = 1) -> int:
    """One replica of the whole model (every stage, every model-parallel rank), as the training
    log counts it (a tied output layer's copy on the last stage included): dense parameters times
    TP, experts times EP x ETP."""
    return sum(s.dense for s in stages) * tp + sum(s.experts for s in stages) * expert_ranks


def active_params(cfg, total: int) -> int:
    """Of ``total`` (``model_params``), those one token's forward pass uses: every dense parameter
    and the shared experts, but only top-k of each MoE layer's routed experts."""
    if not cfg.num_moe_experts:
        return total
    skipped = cfg.num_moe_experts - cfg.moe_router_topk
    return total - sum(moe_pattern(cfg)) * skipped * expert_params(cfg, 1)


# --log-params-norm, as Megatron-LM logs it
def params_l2_norm(model_chunks) -> float:
    """Each parameter counted once: shared embeddings once, tensor-parallel copies (norms, biases)
    once; then summed over the model-parallel ranks. Data-parallel replicas are identical."""
    squares = None
    for chunk in model_chunks:
        for param in chunk.parameters():
            if param_is_not_shared(param) and param_is_not_tensor_parallel_duplicate(param):
                value = param.detach().float().square().sum()
                squares = value if squares is None else squares + value
    device = model_device(model_chunks)  # the params may be in host memory (--offload-params host)
    total = (squares.to(device) if squares is not None else torch.zeros((), device=device)).reshape(1)
    torch.distributed.all_reduce(total, group=parallel_state.get_model_parallel_group())
    return float(total.sqrt().item())


def counted_params(model) -> int:
    """The whole model's parameters (one replica): dense ones summed over the model-parallel group,
    experts over the expert grid (ETP x EP x PP), where each rank holds its own experts."""
    params = [p for chunk in model for p in chunk.parameters()]
    device = model_device(model)  # NCCL has no CPU backend (the params may be in host memory)
    dense = torch.tensor([sum(p.numel() for p in params if getattr(p, "allreduce", True))], dtype=torch.long,
                         device=device)
    experts = torch.tensor([sum(p.numel() for p in params if not getattr(p, "allreduce", True))],
                           dtype=torch.long, device=device)
    torch.distributed.all_reduce(dense, group=parallel_state.get_model_parallel_group())
    if parallel_state.get_expert_model_parallel_world_size() * parallel_state.get_expert_tensor_parallel_world_size() > 1:
        torch.distributed.all_reduce(experts, group=parallel_state.get_expert_tensor_model_pipeline_parallel_group())
    else:
        torch.distributed.all_reduce(experts, group=parallel_state.get_model_parallel_group())
    return int(dense.item() + experts.item())


def kept_input_bytes(seq_length: int, micro_batch_size: int, config) -> float:
    """One layer's input for one micro-batch, kept for its recompute (16-bit; split over the tensor-parallel ranks
    with sequence parallelism)."""
    split = config.tensor_model_parallel_size if config.sequence_parallel else 1
    return 2 * seq_length * micro_batch_size * config.hidden_size / split
