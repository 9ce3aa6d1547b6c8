"""Which Hugging Face models map onto megatron-core's GPTModel, and the Megatron-LM flags that build
each from its config.json; what does not map is refused in one line naming it, before anything is
written.

Families: Llama 2/3/3.1/3.2 (``llama``, Llama 3's RoPE scaling with its published constants),
Mistral (no sliding window), Qwen2/2.5 (QKV bias), Qwen3 (QK norm), Mixtral, Qwen3-MoE and
DeepSeek-V2(-Lite) (multi-latent attention, shared experts, YaRN). ``ModelShape`` holds the sizes the
tensor map needs; ``model_flags`` the flags, one per list item, as ``model_args.txt`` holds them.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from typing import List, Optional

from megatron.training.errors import UserError

DENSE = ("llama", "mistral", "qwen2", "qwen3")
MOE = ("mixtral", "qwen3_moe", "deepseek_v2")
FAMILIES = DENSE + MOE
VOCAB_DIVISOR = 128  # the embedding's rows are padded to a multiple of this (Megatron-LM's default)
# Llama 3.1's RoPE scaling as megatron-core implements it (factor is a flag; these are fixed there)
LLAMA3_FIXED = {"low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}
# YaRN as megatron-core's MLA implements it (the scaling factor and the two mscales are flags)
MLA_YARN_FIXED = {"original_max_position_embeddings": 4096, "beta_fast": 32, "beta_slow": 1}


@dataclass
class ModelShape:
    """What the tensor map needs to know of a model (from config.json, or from a checkpoint's args)."""
    family: str
    layers: int
    hidden: int
    heads: int
    groups: int  # key-value heads
    head_dim: int
    ffn: int
    vocab: int  # the tokenizer's rows in Hugging Face's embedding
    padded_vocab: int  # rows in ours
    tied: bool
    experts: int = 0
    moe_layers: List[int] = field(default_factory=list)  # 1 where the layer is a mixture of experts
    # multi-latent attention (DeepSeek-V2)
    q_lora_rank: Optional[int] = None
    kv_lora_rank: int = 0
    qk_nope_dim: int = 0
    qk_rope_dim: int = 0
    v_head_dim: int = 0

    @property
    def mla(self) -> bool:
        return self.family == "deepseek_v2"


def read_config(hf_dir: str) -> dict:
    path = os.path.join(hf_dir, "config.json")
    if not os.path.isfile(path):
        raise UserError(f"{hf_dir}: no config.json (expected a Hugging Face model directory)")
    with open(path) as f:
        return json.load(f)


def rope_parameters(cfg: dict) -> dict:
    """RoPE's settings as one dict: transformers 5 writes ``rope_parameters``, older configs (most on
    the Hub) ``rope_theta`` and ``rope_scaling``."""
    params = dict(cfg.get("rope_parameters") or {})
    if cfg.get("rope_scaling"):
        params.update(cfg["rope_scaling"])
    if "rope_theta" in cfg and "rope_theta" not in params:
        params["rope_theta"] = cfg["rope_theta"]
    params.setdefault("rope_theta", 10000.0)
    params["rope_type"] = params.get("rope_type") or params.get("type") or "default"
    return params


def _refuse(what: str) -> None:
    raise UserError(f"config.json: {what}")


def _check_common(cfg: dict, family: str) -> None:
    if cfg.get("hidden_act", "silu") != "silu":
        _refuse(f"hidden_act {cfg['hidden_act']!r}: only silu (SwiGLU) maps onto --swiglu")
    if cfg.get("quantization_config"):
        _refuse("quantization_config: a quantized checkpoint; import the unquantized weights")
    if cfg.get("mlp_bias"):
        _refuse("mlp_bias true: Megatron-LM's MLP biases come with biases in every linear layer")
    if cfg.get("attention_bias") and family != "qwen2":
        _refuse("attention_bias true: biases in q/k/v and the output projection have no Megatron-LM flag "
                "(--add-qkv-bias covers q/k/v only)")
    if cfg.get("partial_rotary_factor", 1.0) != 1.0:
        _refuse(f"partial_rotary_factor {cfg['partial_rotary_factor']}: not mapped")
    window = cfg.get("sliding_window")
    if family in ("qwen2", "qwen3", "qwen3_moe"):
        window = window if cfg.get("use_sliding_window") else None
    if window is not None and window < cfg.get("max_position_embeddings", 0):
        _refuse(f"sliding_window {window} (< max_position_embeddings {cfg['max_position_embeddings']}): "
                "this project's attention has no sliding window")
    kinds = set(cfg.get("layer_types") or ["full_attention"])
    if kinds != {"full_attention"}:
        _refuse(f"layer_types {sorted(kinds)}: only full attention maps")


def _rope_flags(cfg: dict, family: str) -> List[str]:
    rope = rope_parameters(cfg)
    kind = rope["rope_type"]
    flags = ["--position-embedding-type", "rope", "--rotary-base", _num(rope["rope_theta"])]
    if family == "deepseek_v2":
        if kind == "default":
            return flags + ["--rope-type", "rope"]
        if kind != "yarn":
            _refuse(f"rope_type {kind!r}: DeepSeek-V2's attention maps with default RoPE or YaRN only")
        _check_fixed(rope, MLA_YARN_FIXED, "yarn")
        return flags + ["--rope-type", "yarn", "--rotary-scaling-factor", _num(rope["factor"]),
                        "--mscale", _num(rope.get("mscale", 1.0)),
                        "--mscale-all-dim", _num(rope.get("mscale_all_dim", 0.0))]
    if kind == "default":
        return flags
    if kind == "llama3":
        _check_fixed(rope, LLAMA3_FIXED, "llama3")
        return flags + ["--use-rope-scaling", "--rope-scaling-factor", _num(rope["factor"])]
    _refuse(f"rope_type {kind!r}: not implemented here (default RoPE and Llama 3's llama3 scaling are)")


def _check_fixed(rope: dict, fixed: dict, kind: str) -> None:
    for name, value in fixed.items():
        if name in rope and float(rope[name]) != float(value):
            _refuse(f"rope_type {kind!r} with {name} {rope[name]}: megatron-core fixes it at {value}")


def _num(value) -> str:
    return repr(int(value)) if float(value).is_integer() and abs(value) < 1e15 else repr(float(value))


def model_shape(cfg: dict) -> ModelShape:
    """The sizes of a config.json's model, after refusing what does not map."""
    family = cfg.get("model_type")
    if family not in FAMILIES:
        _refuse(f"model_type {family!r}: not one of {', '.join(FAMILIES)}")
    _check_common(cfg, family)
    heads = cfg["num_attention_heads"]
    hidden = cfg["hidden_size"]
    vocab = cfg["vocab_size"]
    shape = ModelShape(
        family=family, layers=cfg["num_hidden_layers"], hidden=hidden, heads=heads,
        groups=cfg.get("num_key_value_heads") or heads, head_dim=cfg.get("head_dim") or hidden // heads,
        ffn=cfg["intermediate_size"], vocab=vocab, padded_vocab=-(-vocab // VOCAB_DIVISOR) * VOCAB_DIVISOR,
        tied=bool(cfg.get("tie_word_embeddings", False)))
    if family == "mixtral":
        shape.experts = cfg["num_local_experts"]
        shape.moe_layers = [1] * shape.layers
    elif family == "qwen3_moe":
        shape.experts = cfg.get("num_experts") or cfg["num_local_experts"]
        step, dense = cfg.get("decoder_sparse_step", 1), set(cfg.get("mlp_only_layers") or [])
        shape.moe_layers = [int(i not in dense and (i + 1) % step == 0) for i in range(shape.layers)]
    elif family == "deepseek_v2":
        _check_deepseek(cfg)
        shape.experts = cfg["n_routed_experts"] or 0
        first, freq = cfg.get("first_k_dense_replace", 0), cfg.get("moe_layer_freq", 1)
        shape.moe_layers = [int(bool(shape.experts) and i >= first and i % freq == 0) for i in range(shape.layers)]
        shape.q_lora_rank = cfg.get("q_lora_rank")
        shape.kv_lora_rank = cfg["kv_lora_rank"]
        shape.qk_nope_dim, shape.qk_rope_dim = cfg["qk_nope_head_dim"], cfg["qk_rope_head_dim"]
        shape.v_head_dim = cfg["v_head_dim"]
        shape.groups = heads
    if shape.experts and not any(shape.moe_layers):
        shape.experts = 0
    return shape


def _check_deepseek(cfg: dict) -> None:
    if cfg.get("topk_method", "greedy") != "greedy" and (cfg.get("n_group") or 1) > 1:
        _refuse(f"topk_method {cfg['topk_method']!r} with n_group {cfg['n_group']}: megatron-core's group-limited "
                "routing scores groups differently")
    if cfg.get("scoring_func", "softmax") != "softmax":
        _refuse(f"scoring_func {cfg['scoring_func']!r}: DeepSeek-V2 maps with softmax routing")


def model_flags(cfg: dict) -> List[str]:
    """The Megatron-LM flags that build the model of ``cfg`` (dropouts as the config has them)."""
    shape = model_shape(cfg)
    family = shape.family
    flags = ["--num-layers", str(shape.layers), "--hidden-size", str(shape.hidden),
             "--num-attention-heads", str(shape.heads), "--ffn-hidden-size", str(shape.ffn),
             "--max-position-embeddings", str(cfg["max_position_embeddings"]),
             "--normalization", "RMSNorm", "--norm-epsilon", _num(cfg.get("rms_norm_eps", 1e-6)),
             "--swiglu", "--disable-bias-linear", "--padded-vocab-size", str(shape.padded_vocab),
             "--attention-dropout", _num(cfg.get("attention_dropout", 0.0)), "--hidden-dropout", "0"]
    if not shape.tied:
        flags.append("--untie-embeddings-and-output-weights")
    if not shape.mla:
        flags += ["--kv-channels", str(shape.head_dim)]
        if shape.groups != shape.heads:
            flags += ["--group-query-attention", "--num-query-groups", str(shape.groups)]
    flags += _rope_flags(cfg, family)
    if family == "qwen2":
        flags.append("--add-qkv-bias")
    if family in ("qwen3", "qwen3_moe"):
        flags.append("--qk-layernorm")
    if shape.mla:
        flags += ["--multi-latent-attention", "--qk-layernorm", "--kv-lora-rank", str(shape.kv_lora_rank),
                  "--qk-head-dim", str(shape.qk_nope_dim), "--qk-pos-emb-head-dim", str(shape.qk_rope_dim),
                  "--v-head-dim", str(shape.v_head_dim)]
        if shape.q_lora_rank:
            flags += ["--q-lora-rank", str(shape.q_lora_rank)]
    if shape.experts:
        flags += _moe_flags(cfg, shape)
    return flags


def _moe_flags(cfg: dict, shape: ModelShape) -> List[str]:
    family = shape.family
    expert_ffn = cfg["intermediate_size"] if family == "mixtral" else cfg["moe_intermediate_size"]
    flags = ["--num-experts", str(shape.experts), "--moe-router-topk", str(cfg["num_experts_per_tok"]),
             "--moe-ffn-hidden-size", str(expert_ffn)]
    if not all(shape.moe_layers):
        flags += ["--moe-layer-freq", "[" + ",".join(map(str, shape.moe_layers)) + "]"]
    # Top-k of the softmax over all experts, renormalised over the k (Mixtral, Qwen3-MoE's
    # norm_topk_prob) is megatron-core's default order (top-k of the logits, then their softmax);
    # without the renormalisation it is --moe-router-pre-softmax.
    renormalised = family == "mixtral" or (family == "qwen3_moe" and cfg.get("norm_topk_prob", False))
    if not renormalised:
        flags.append("--moe-router-pre-softmax")
    if family == "deepseek_v2":
        if cfg.get("routed_scaling_factor", 1.0) != 1.0:
            flags += ["--moe-router-topk-scaling-factor", _num(cfg["routed_scaling_factor"])]
        if cfg.get("n_shared_experts"):
            flags += ["--moe-shared-expert-intermediate-size", str(cfg["n_shared_experts"] * expert_ffn)]
    return flags


# -- a config.json for a checkpoint that did not come from one ---------------------------------------
_ARCHITECTURES = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM",
                  "mixtral": "MixtralForCausalLM", "qwen3_moe": "Qwen3MoeForCausalLM"}


def config_from_args(saved) -> dict:
    """A config.json for the model a checkpoint's saved args describe (a run trained from scratch): the
    family its flags amount to, or one line naming the flag no family here has. Its vocabulary is the
    embedding's rows (the tokenizer's own size is not in the args)."""
    def arg(name, default=None):
        return getattr(saved, name, default)

    needed = {"--normalization RMSNorm": arg("normalization") == "RMSNorm", "--swiglu": bool(arg("swiglu")),
              "--disable-bias-linear": bool(arg("disable_bias_linear")),
              "--position-embedding-type rope": arg("position_embedding_type") == "rope"}
    for flag, given in needed.items():
        if not given:
            raise UserError(f"the checkpoint's model was trained without {flag}: no Hugging Face family here matches; "
                            "pass --hf-template with a config.json of the same model")
    for flag, value, plain in (("--apply-layernorm-1p", arg("apply_layernorm_1p"), False),
                               ("--rotary-interleaved", arg("rotary_interleaved"), False),
                               ("--rotary-percent", arg("rotary_percent", 1.0), 1.0),
                               ("--multi-latent-attention", arg("multi_latent_attention"), False),
                               ("--moe-shared-expert-intermediate-size", arg("moe_shared_expert_intermediate_size"), None)):
        if value is not None and value != plain:
            raise UserError(f"the checkpoint's model has {flag} {value}: not derived into a config.json here; pass "
                            "--hf-template with a config.json of the same model")
    heads = arg("num_attention_heads")
    experts = arg("num_experts")
    family = ("qwen3_moe" if arg("qk_layernorm") else "mixtral") if experts else \
        "qwen3" if arg("qk_layernorm") else "qwen2" if arg("add_qkv_bias") else "llama"
    cfg = {"architectures": [_ARCHITECTURES[family]], "model_type": family, "hidden_act": "silu",
           "vocab_size": arg("padded_vocab_size") or arg("vocab_size"), "hidden_size": arg("hidden_size"),
           "intermediate_size": arg("ffn_hidden_size"), "num_hidden_layers": arg("num_layers"),
           "num_attention_heads": heads, "num_key_value_heads": arg("num_query_groups") or heads,
           "head_dim": arg("kv_channels") or arg("hidden_size") // heads,
           "max_position_embeddings": arg("max_position_embeddings"), "rms_norm_eps": arg("norm_epsilon", 1e-5),
           "tie_word_embeddings": not arg("untie_embeddings_and_output_weights"),
           "attention_dropout": arg("attention_dropout", 0.0), "rope_theta": arg("rotary_base", 10000)}
    if arg("use_rope_scaling"):
        cfg["rope_scaling"] = {"rope_type": "llama3", "factor": arg("rope_scaling_factor"), **LLAMA3_FIXED}
    if experts:
        cfg.update(_moe_config(saved, family, experts))
    model_shape(cfg)  # what it describes maps back (refusals in one line)
    return cfg


def _moe_config(saved, family: str, experts: int) -> dict:
    from megatron.training.model.moe import moe_layers

    pattern = moe_layers(saved.num_layers, getattr(saved, "moe_layer_freq", 1))
    pre_softmax = bool(getattr(saved, "moe_router_pre_softmax", False))
    topk = getattr(saved, "moe_router_topk", 2)
    if family == "mixtral":
        expert_ffn = getattr(saved, "moe_ffn_hidden_size", None)
        if not all(pattern) or pre_softmax or expert_ffn not in (None, saved.ffn_hidden_size):
            raise UserError("the checkpoint's mixture of experts has dense layers, --moe-router-pre-softmax or an "
                            "expert FFN apart from --ffn-hidden-size: Mixtral's form has none of them (with "
                            "--qk-layernorm it would be Qwen3-MoE's); pass --hf-template")
        return {"num_local_experts": experts, "num_experts_per_tok": topk}
    return {"num_experts": experts, "num_experts_per_tok": topk, "norm_topk_prob": not pre_softmax,
            "moe_intermediate_size": getattr(saved, "moe_ffn_hidden_size", None) or saved.ffn_hidden_size,
            "decoder_sparse_step": 1, "mlp_only_layers": [i for i, moe in enumerate(pattern) if not moe]}
