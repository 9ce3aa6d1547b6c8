"""megatron-core's TransformerConfig and OptimizerConfig from Megatron-LM style flags (sizes and kernel
choices were derived when the flags were parsed)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from megatron.core.distributed import DistributedDataParallelConfig
from megatron.core.optimizer import OptimizerConfig
from megatron.core.transformer import MLATransformerConfig, TransformerConfig

from megatron.training.model import precision_aware, uneven_pipeline


def params_dtype(args):
    return torch.bfloat16 if args.bf16 else torch.float16 if args.fp16 else torch.float32


def _sends_run_behind(args) -> bool:
    """Whether a pipeline send may still be reading its tensor after the schedule moves on: gloo's
    isend (CPU) with the interleaved schedule's overlapped sends. megatron-core then frees a sent
    activation's storage (deallocate_pipeline_outputs), safe only where CUDA streams order the two;
    on gloo the send read freed memory (NaN grads). Keeping the storage changes no numerics."""
    return args.overlap_p2p_comm and getattr(args, "device_resolved", None) == "cpu"


def xavier_init_fields(args) -> dict:
    """--init-method-xavier-uniform: as Megatron-LM, the layers' and the output layers' weights Xavier-uniform."""
    if not args.init_method_xavier_uniform:
        return {}
    return {"init_method": torch.nn.init.xavier_uniform_, "output_layer_init_method": torch.nn.init.xavier_uniform_}


def transformer_config(args) -> TransformerConfig:
    """TransformerConfig from Megatron-LM style flags. The sizes (FFN, kv-channels, GQA) and the
    kernel choices (attention backend, fusions, FP8) were derived in parsing (``args/megatron.py``)."""
    from megatron.core.transformer.enums import AttnBackend

    dtype = params_dtype(args)
    mla = getattr(args, "multi_latent_attention", False)
    config_class = MLATransformerConfig if mla else TransformerConfig
    config = config_class(
        num_layers=args.num_layers,
        hidden_size=args.hidden_size,
        ffn_hidden_size=args.ffn_hidden_size,
        num_attention_heads=args.num_attention_heads,
        kv_channels=args.kv_channels,
        num_query_groups=args.num_query_groups,  # None unless --group-query-attention, as Megatron-LM
        hidden_dropout=args.hidden_dropout,
        attention_dropout=args.attention_dropout,
        init_method_std=args.init_method_std,
        **xavier_init_fields(args),
        normalization=args.normalization,
        gated_linear_unit=args.swiglu,
        activation_func=F.silu if args.swiglu else F.gelu,
        add_bias_linear=not args.disable_bias_linear,
        tensor_model_parallel_size=args.tensor_model_parallel_size,
        pipeline_model_parallel_size=args.pipeline_model_parallel_size,
        virtual_pipeline_model_parallel_size=args.virtual_pipeline_model_parallel_size,
        # As Megatron-LM: the interleaved schedule overlaps its sends and receives unless told not to.
        overlap_p2p_comm=args.overlap_p2p_comm,
        batch_p2p_comm=not args.overlap_p2p_comm,
        microbatch_group_size_per_vp_stage=args.microbatch_group_size_per_vp_stage,
        **uneven_pipeline.config_fields(args),
        sequence_parallel=args.sequence_parallel,
        bf16=args.bf16,
        fp16=args.fp16,
        params_dtype=dtype,
        pipeline_dtype=dtype,
        recompute_granularity=args.recompute_granularity,
        recompute_method=args.recompute_method if args.recompute_granularity == "full" else None,
        recompute_num_layers=args.recompute_num_layers if args.recompute_granularity == "full" else None,
        attention_backend=AttnBackend[args.attention_backend],
        transformer_impl=args.transformer_impl,  # as Megatron-LM; the parameter counts read it (MLA's layout)
        bias_activation_fusion=args.bias_activation_fusion,
        bias_dropout_fusion=args.bias_dropout_fusion,
        calculate_per_token_loss=args.calculate_per_token_loss,
        masked_softmax_fusion=args.masked_softmax_fusion,
        apply_rope_fusion=args.apply_rope_fusion,
        gradient_accumulation_fusion=args.gradient_accumulation_fusion,
        persist_layer_norm=args.persist_layer_norm,
        layernorm_zero_centered_gamma=args.apply_layernorm_1p,
        cross_entropy_loss_fusion=args.cross_entropy_loss_fusion,
        fp8=args.fp8_format,
        **({"fp8_recipe": args.fp8_recipe} if args.fp8_recipe else {}),
        fp8_margin=args.fp8_margin,
        fp8_amax_history_len=args.fp8_amax_history_len,
        fp8_amax_compute_algo=args.fp8_amax_compute_algo,
        fp8_param=args.fp8_param_gather,
        use_cpu_initialization=False,
        deallocate_pipeline_outputs=not _sends_run_behind(args),
        qk_layernorm=args.qk_layernorm,
        deterministic_mode=getattr(args, "deterministic_mode", False),
        **moe_fields(args),
        **rope_bias_norm_fields(args),
        **(mla_fields(args) if mla else {}),
    )
    if getattr(args, "position_embedding_type", None) == "yarn":
        _set_yarn_attributes(config, args)
    return config


def _set_yarn_attributes(config, args) -> None:
    """megatron-core's GPTModel reads YaRN's settings as plain attributes of the config (no fields):
    from the flags, with YarnRotaryEmbedding's defaults where a flag is not given, as Megatron-LM sets them."""
    given = {"yarn_rotary_scaling_factor": (args.rotary_scaling_factor, 1.0),
             "yarn_original_max_position_embeddings": (args.yarn_original_max_position_embeddings, 4096),
             "yarn_beta_fast": (args.yarn_beta_fast, 32.0), "yarn_beta_slow": (args.yarn_beta_slow, 1.0),
             "yarn_mscale": (args.mscale, 1.0), "yarn_mscale_all_dim": (args.mscale_all_dim, 0.0),
             "yarn_correction_range_round_to_int": (args.yarn_correction_range_round_to_int, True)}
    for name, (value, default) in given.items():
        setattr(config, name, default if value is None else value)


def rope_bias_norm_fields(args) -> dict:
    """The RoPE variant, QKV bias and norm epsilon flags (Megatron-LM's defaults for a Namespace
    parsed before they existed)."""
    return dict(
        add_qkv_bias=getattr(args, "add_qkv_bias", not args.disable_bias_linear),
        layernorm_epsilon=getattr(args, "norm_epsilon", 1e-5),
        rotary_interleaved=getattr(args, "rotary_interleaved", False),
        no_rope_freq=getattr(args, "no_rope_freq", None),
    )


def mla_fields(args) -> dict:
    """MLATransformerConfig's fields from the --multi-latent-attention flags (args.mla)."""
    fields = dict(
        q_lora_rank=args.q_lora_rank,
        kv_lora_rank=args.kv_lora_rank,
        qk_head_dim=args.qk_head_dim,
        qk_pos_emb_head_dim=args.qk_pos_emb_head_dim,
        v_head_dim=args.v_head_dim,
        rotary_base=args.rotary_base,
        rotary_percent=args.rotary_percent,
        rotary_scaling_factor=args.rotary_scaling_factor,
        mscale=args.mscale,
        mscale_all_dim=args.mscale_all_dim,
    )
    if args.rope_type is not None:  # else MLATransformerConfig's default (yarn), as Megatron-LM
        fields["rope_type"] = args.rope_type
    return fields


def moe_fields(args) -> dict:
    """TransformerConfig's mixture-of-experts fields from the --num-experts/--moe-*/--expert-* flags
    (none for a dense model: megatron-core's defaults then hold)."""
    if getattr(args, "num_experts", None) is None:
        return {}
    return dict(
        num_moe_experts=args.num_experts,
        moe_ffn_hidden_size=args.moe_ffn_hidden_size,
        moe_layer_freq=args.moe_layer_freq,
        moe_shared_expert_intermediate_size=args.moe_shared_expert_intermediate_size,
        moe_shared_expert_overlap=args.moe_shared_expert_overlap,
        moe_router_topk=args.moe_router_topk,
        moe_router_load_balancing_type=args.moe_router_load_balancing_type,
        moe_aux_loss_coeff=args.moe_aux_loss_coeff,
        moe_z_loss_coeff=args.moe_z_loss_coeff,
        moe_input_jitter_eps=args.moe_input_jitter_eps,
        moe_router_dtype=args.moe_router_dtype,
        moe_router_score_function=args.moe_router_score_function,
        moe_router_pre_softmax=args.moe_router_pre_softmax,
        moe_router_topk_scaling_factor=args.moe_router_topk_scaling_factor,
        moe_router_num_groups=args.moe_router_num_groups,
        moe_router_group_topk=args.moe_router_group_topk,
        moe_router_enable_expert_bias=args.moe_router_enable_expert_bias,
        moe_router_bias_update_rate=args.moe_router_bias_update_rate,
        moe_token_dispatcher_type=args.moe_token_dispatcher_type,
        moe_expert_capacity_factor=args.moe_expert_capacity_factor,
        moe_pad_expert_input_to_capacity=args.moe_pad_expert_input_to_capacity,
        moe_token_drop_policy=args.moe_token_drop_policy,
        # Without its kernel, megatron-core's sequential experts (``args/moe.py``): the same arithmetic.
        moe_grouped_gemm=args.moe_grouped_gemm_kernel in ("te", "grouped_gemm"),
        moe_permute_fusion=args.moe_permute_fusion,
        moe_per_layer_logging=args.moe_per_layer_logging,
        moe_layer_recompute=args.moe_layer_recompute,
        expert_model_parallel_size=args.expert_model_parallel_size,
        expert_tensor_parallel_size=args.expert_tensor_parallel_size,
    )


def optimizer_config(args) -> OptimizerConfig:
    return OptimizerConfig(
        optimizer="adam",
        lr=args.lr,
        min_lr=args.min_lr,
        weight_decay=args.weight_decay,
        adam_beta1=args.adam_beta1,
        adam_beta2=args.adam_beta2,
        adam_eps=args.adam_eps,
        clip_grad=args.clip_grad,
        bf16=args.bf16,
        fp16=args.fp16,
        params_dtype=params_dtype(args),
        loss_scale=args.loss_scale,
        initial_loss_scale=args.initial_loss_scale,
        min_loss_scale=args.min_loss_scale,
        loss_scale_window=args.loss_scale_window,
        hysteresis=args.hysteresis,
        use_distributed_optimizer=args.use_distributed_optimizer,
        decoupled_lr=args.decoupled_lr,
        decoupled_min_lr=args.decoupled_min_lr,
        # megatron-core's own CPU offload (a peer to compare with); off unless asked for.
        optimizer_cpu_offload=getattr(args, "optimizer_cpu_offload", False),
        optimizer_offload_fraction=getattr(args, "optimizer_offload_fraction", 1.0),
        overlap_cpu_optimizer_d2h_h2d=getattr(args, "overlap_cpu_optimizer_d2h_h2d", False),
        log_num_zeros_in_grad=getattr(args, "log_num_zeros_in_grad", False),
        **precision_aware.optimizer_config_fields(args),
    )


def ddp_config_of(args) -> DistributedDataParallelConfig:
    """megatron-core DDP's settings from the flags."""
    return DistributedDataParallelConfig(
        # as Megatron-LM: bf16 grads are accumulated/reduced in fp32 unless --grad-reduce-in-bf16
        grad_reduce_in_fp32=args.bf16 and not args.grad_reduce_in_bf16,
        overlap_grad_reduce=args.overlap_grad_reduce,
        overlap_param_gather=args.overlap_param_gather,
        use_distributed_optimizer=args.use_distributed_optimizer,
        # fp16 overflow (inf/NaN grads) is the grad scaler's job: it skips the step and backs off.
        check_for_nan_in_grad=not args.fp16 and args.check_for_nan_in_loss_and_grad,
        bucket_size=None if not args.overlap_grad_reduce else 40_000_000,
    )
