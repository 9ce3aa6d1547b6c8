"""Pretrain a GPT model with megatron-core (our own training layer, Megatron-LM flag style).

    torchrun --nproc_per_node 2 pretrain_gpt.py --tensor-model-parallel-size 2 \
        --num-layers 4 --hidden-size 64 --num-attention-heads 4 --seq-length 64 \
        --micro-batch-size 2 --global-batch-size 8 --train-iters 10 --lr 1e-3 --bf16 \
        --mock-data --device cpu
"""

import sys
from functools import partial

from megatron.training.runtime.lean_imports import avoid_unused_imports

avoid_unused_imports(sys.argv[1:])  # before megatron-core is imported: seconds per rank on a CPU run

import torch  # noqa: E402

from megatron.training.errors import UserError  # noqa: E402


def _layer_spec(args, config, vp_stage=None):
    """Transformer-Engine layers when --transformer-impl resolved to them (TE installed, CUDA, not
    --attention-backend local); megatron-core's local ones otherwise, with torch's SDPA as their core
    attention where the flags chose it (model/kernels.py)."""
    from megatron.core.models.gpt.gpt_layer_specs import (
        get_gpt_decoder_block_spec, get_gpt_layer_local_spec, get_gpt_layer_with_transformer_engine_spec)
    from megatron.training.model.attention_spec import with_core_attention

    if args.transformer_impl == "transformer_engine" and args.device_resolved == "cuda":
        try:
            import transformer_engine  # noqa: F401

            if args.num_experts is not None:  # per-layer specs: --moe-layer-freq mixes dense and MoE layers
                return get_gpt_decoder_block_spec(config, use_transformer_engine=True, vp_stage=vp_stage)
            return get_gpt_layer_with_transformer_engine_spec(fp8=args.fp8_format, qk_layernorm=args.qk_layernorm,
                                                              multi_latent_attention=args.multi_latent_attention)
        except ImportError as err:  # a broken TE build
            raise UserError(f"--transformer-impl transformer_engine: transformer-engine does not import ({err})")
    if args.sequence_parallel:
        raise UserError("--sequence-parallel: needs transformer-engine layers; "
                         "megatron-core's local layer spec uses torch norms that do not support it")
    if args.num_experts is not None:
        spec = get_gpt_decoder_block_spec(config, use_transformer_engine=False, normalization=args.normalization,
                                          vp_stage=vp_stage)
    else:
        spec = get_gpt_layer_local_spec(normalization=args.normalization, qk_layernorm=args.qk_layernorm,
                                        multi_latent_attention=args.multi_latent_attention)
    if args.multi_latent_attention:  # megatron-core's local attention takes no separate key/value widths
        from megatron.training.model.mla_attention import local_mla_spec

        return local_mla_spec(spec)
    return with_core_attention(spec, args)


def model_provider(args, config, pre_process=True, post_process=True, vp_stage=None):
    """``vp_stage``: which model chunk of this pipeline rank, with the interleaved pipeline (its layers)."""
    from megatron.core.models.gpt import GPTModel

    return GPTModel(
        config=config,
        transformer_layer_spec=_layer_spec(args, config, vp_stage),
        vocab_size=args.padded_vocab_size,
        max_sequence_length=args.max_position_embeddings,
        pre_process=pre_process,
        post_process=post_process,
        share_embeddings_and_output_weights=not args.untie_embeddings_and_output_weights,
        position_embedding_type=args.position_embedding_type,
        rotary_base=args.rotary_base,
        rotary_percent=args.rotary_percent,
        rope_scaling=args.use_rope_scaling,
        rope_scaling_factor=args.rope_scaling_factor,
        seq_len_interpolation_factor=args.rotary_seq_len_interpolation_factor,
        vp_stage=vp_stage,
    )


def datasets_provider(args, tokenizer, train_samples, eval_samples):
    from megatron.training.data.datasets import build_gpt_datasets

    return build_gpt_datasets(args, tokenizer, train_samples, eval_samples)


def loss_func(loss_mask, output_tensor):
    """Megatron-LM's form: the micro-batch's summed token loss, its token count, and both for the log.
    megatron-core's schedule divides by the count (or, with --calculate-per-token-loss, scales the
    gradients by the step's total count instead)."""
    losses = output_tensor.float().view(-1)
    mask = loss_mask.view(-1).float()
    loss = torch.sum(losses * mask)
    num_tokens = mask.sum().to(torch.int)
    return loss, num_tokens, {"lm loss": torch.cat([loss.detach().view(1), num_tokens.view(1).float()])}


def forward_step(data_iterator, model):
    from megatron.training.runtime.progress import model_device

    batch = next(data_iterator)
    device = model_device([model])  # (with --offload-params host a later stage's first param is in host memory)
    tokens = batch["tokens"].to(device)
    labels = batch["labels"].to(device)
    output = model(tokens, batch["position_ids"].to(device), None, labels=labels)
    return output, partial(loss_func, batch["loss_mask"].to(device))


if __name__ == "__main__":  # required: dist_checkpointing's writer starts child processes
    from megatron.training.training import pretrain

    pretrain(model_provider, datasets_provider, forward_step)
