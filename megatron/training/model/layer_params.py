"""Parameters of one transformer layer on one model-parallel rank, as megatron-core's layer specs
build it (local and transformer-engine specs hold the same tensors): attention, a dense MLP, or a
mixture-of-experts MLP split into what every tensor-parallel rank holds (``dense``: norms, router,
shared experts; sharded by the dense optimizer over data parallelism) and what one expert-parallel
rank holds (``experts``: its local experts; sharded by the experts' optimizer over expert-data
parallelism). Tensor parallelism splits the linear layers (experts: expert-tensor parallelism);
norms, the router and row-parallel biases are whole on every rank.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import List

from megatron.training.model.moe import moe_layers


@dataclass(frozen=True)
class LayerParams:
    dense: int  # on one tensor-parallel rank
    experts: int = 0  # this expert-parallel rank's routed experts, on one expert-tensor-parallel rank


def _norm(cfg, width: int) -> int:
    return width * (2 if cfg.normalization == "LayerNorm" else 1)  # LayerNorm has a bias, RMSNorm not


def attention_params(cfg, tp: int) -> int:
    """Input norm, QKV (GQA: query groups share K and V), output projection, optional Q/K norms."""
    if getattr(cfg, "multi_latent_attention", False):
        return mla_params(cfg, tp)
    h, heads = cfg.hidden_size, cfg.num_attention_heads
    q = heads * cfg.kv_channels
    kv = (cfg.num_query_groups or heads) * cfg.kv_channels
    bias = cfg.add_bias_linear
    qkv = h * (q + 2 * kv) // tp + ((q + 2 * kv) // tp if bias or cfg.add_qkv_bias else 0)
    proj = q // tp * h + (h if bias else 0)  # row-parallel: its bias is whole on every rank
    qk_norms = 2 * _norm(cfg, cfg.kv_channels) if getattr(cfg, "qk_layernorm", False) else 0
    return _norm(cfg, h) + qkv + proj + qk_norms


def mla_params(cfg, tp: int) -> int:
    """Multi-latent attention (megatron-core's MLASelfAttention, no biases but the output's): the input
    norm; queries through a down projection to q_lora_rank, its norm and an up projection to every
    head's qk + pos width (or one projection without q_lora_rank); keys and values through one down
    projection to the kv latent plus the shared RoPE key, its norm and an up projection to every head's
    qk + v width; the output projection. The up projections and the output split over TP; the down
    projections too on megatron-core's local layers, while transformer-engine's keep them whole on
    every rank. The latents' norms (with --qk-layernorm) are whole on every rank."""
    h, heads = cfg.hidden_size, cfg.num_attention_heads
    q_head = cfg.qk_head_dim + cfg.qk_pos_emb_head_dim
    down_tp = tp if getattr(cfg, "transformer_impl", "transformer_engine") == "local" else 1
    latent_norm = (lambda width: _norm(cfg, width)) if cfg.qk_layernorm else (lambda width: 0)
    if cfg.q_lora_rank is None:
        query = h * heads * q_head // tp
    else:
        query = h * cfg.q_lora_rank // down_tp + latent_norm(cfg.q_lora_rank) + cfg.q_lora_rank * heads * q_head // tp
    key_value = (h * (cfg.kv_lora_rank + cfg.qk_pos_emb_head_dim) // down_tp + latent_norm(cfg.kv_lora_rank)
                 + cfg.kv_lora_rank * heads * (cfg.qk_head_dim + cfg.v_head_dim) // tp)
    proj = heads * cfg.v_head_dim // tp * h + (h if cfg.add_bias_linear else 0)
    return _norm(cfg, h) + query + key_value + proj


def mlp_params(cfg, ffn: int, tp: int, bias: bool) -> int:
    """fc1 (SwiGLU: gate and up, two ffn-wide halves) and fc2 of an MLP of width ``ffn``, no norm."""
    h = cfg.hidden_size
    fc1_out = ffn * (2 if cfg.gated_linear_unit else 1)
    fc1 = h * fc1_out // tp + (fc1_out // tp if bias else 0)
    fc2 = ffn // tp * h + (h if bias else 0)
    return fc1 + fc2


def expert_params(cfg, etp: int) -> int:
    """One routed expert on one expert-tensor-parallel rank."""
    return mlp_params(cfg, cfg.moe_ffn_hidden_size, etp, cfg.add_bias_linear)


def moe_dense_params(cfg, tp: int) -> int:
    """What an MoE layer's MLP part holds outside its routed experts: the pre-MLP norm, the router
    (fp32, whole on every rank) and the shared experts (megatron-core refuses biases there)."""
    h, experts = cfg.hidden_size, cfg.num_moe_experts
    router = experts * h + (experts if cfg.add_bias_linear else 0)
    shared = 0
    if cfg.moe_shared_expert_intermediate_size:
        shared = mlp_params(cfg, cfg.moe_shared_expert_intermediate_size, tp, bias=False)
        shared += h if getattr(cfg, "moe_shared_expert_gate", False) else 0
    return _norm(cfg, h) + router + shared


def layer_params(cfg, is_moe: bool) -> LayerParams:
    """One layer on one rank of the config's parallel layout."""
    tp = cfg.tensor_model_parallel_size
    attention = attention_params(cfg, tp)
    if not is_moe:
        return LayerParams(attention + _norm(cfg, cfg.hidden_size) + mlp_params(cfg, cfg.ffn_hidden_size, tp,
                                                                                 cfg.add_bias_linear))
    etp = cfg.expert_tensor_parallel_size or tp
    local_experts = cfg.num_moe_experts // (cfg.expert_model_parallel_size or 1)
    return LayerParams(attention + moe_dense_params(cfg, tp), local_experts * expert_params(cfg, etp))


def moe_pattern(cfg) -> List[int]:
    """1 where a layer is MoE (all 0 for a dense model)."""
    if not cfg.num_moe_experts:
        return [0] * cfg.num_layers
    return moe_layers(cfg.num_layers, cfg.moe_layer_freq)


def stage_layer_counts(cfg) -> List[int]:
    """Transformer layers each pipeline rank builds (all its chunks), split as megatron-core's
    get_num_layers_to_build splits them: the first and the last rank's own counts where the config gives
    them and the rest evenly over the ranks between; else evenly, where the embedding and the loss may
    each take a layer's place on their rank. (Fake configs of tests may leave the uneven fields out.)"""
    pp = cfg.pipeline_model_parallel_size
    first = getattr(cfg, "num_layers_in_first_pipeline_stage", None)
    last = getattr(cfg, "num_layers_in_last_pipeline_stage", None)
    if first is not None or last is not None:
        given = [n for n in (first, last) if n is not None]
        between = pp - len(given)
        counts = [(cfg.num_layers - sum(given)) // between if between else 0] * pp
        counts[0] = counts[0] if first is None else first
        counts[-1] = counts[-1] if last is None else last
        return counts
    embedding = bool(getattr(cfg, "account_for_embedding_in_pipeline_split", False))
    loss = bool(getattr(cfg, "account_for_loss_in_pipeline_split", False))
    counts = [(cfg.num_layers + embedding + loss) // pp] * pp
    counts[0] -= embedding
    counts[-1] -= loss
    return counts


def layers_of_stage(cfg, stage: int) -> List[int]:
    """The layer numbers (from 0) pipeline rank ``stage`` builds: one contiguous run (``stage_layer_counts``),
    or with V chunks per rank (the interleaved pipeline) chunks stage, stage + PP, ... of PP x V equal runs."""
    pp = cfg.pipeline_model_parallel_size
    chunks = cfg.virtual_pipeline_model_parallel_size or 1
    if chunks == 1:
        counts = stage_layer_counts(cfg)
        return list(range(sum(counts[:stage]), sum(counts[:stage + 1])))
    per_chunk = cfg.num_layers // (pp * chunks)
    return [(v * pp + stage) * per_chunk + i for v in range(chunks) for i in range(per_chunk)]
