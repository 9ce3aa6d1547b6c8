"""Megatron-LM's model, training, scheduler and parallelism flags beyond the core set in
``arguments``, with Megatron-LM's defaults and meaning, so its example scripts run unchanged.

``add_groups(parser)`` adds them; ``validate(parser, args)`` derives what Megatron-LM derives
(--recompute-activations, the FFN and head sizes, GQA only with --group-query-attention, sample-based
schedules) and fails with one line naming the flag where a feature needs something absent here.
"""

from __future__ import annotations

import argparse

from megatron.training.args.moe import layer_pattern
from megatron.training.data import lr_schedule
from megatron.training.model import kernels as optional_kernels, uneven_pipeline, virtual_pipeline
from megatron.training.errors import finite, fraction, non_negative_float, non_negative_int, positive_float, positive_int
from megatron.training.flag_types import only
from megatron.training.model.sizes import default_ffn_hidden_size, default_kv_channels


def add_groups(p: argparse.ArgumentParser) -> None:
    _add_model(p)
    _add_rope_bias_and_vocab(p)
    _add_kernels(p)
    _add_training(p)
    _add_scheduler(p)
    _add_parallelism(p)


def _add_model(p) -> None:
    g = p.add_argument_group("model (Megatron-LM)")
    g.add_argument("--group-query-attention", action="store_true",
                   help="grouped-query attention with --num-query-groups KV heads (without it, plain multi-head)")
    g.add_argument("--kv-channels", type=positive_int, default=None,
                   help="size of each attention head; default --hidden-size / --num-attention-heads")
    g.add_argument("--make-vocab-size-divisible-by", type=positive_int, default=128,
                   help="pad the vocabulary to a multiple of this x TP (default 128)")
    g.add_argument("--rotary-percent", type=fraction, default=1.0, help="fraction of each head that RoPE rotates")
    g.add_argument("--apply-layernorm-1p", action="store_true",
                   help="zero-centered layer-norm gamma (weight + 1); needs TE or apex norms")
    g.add_argument("--use-mcore-models", action="store_true", help="accepted for Megatron-LM scripts: always the case")
    g.add_argument("--qk-layernorm", action="store_true", help="normalize queries and keys per head (Qwen3, OLMo 2)")
    g.add_argument("--use-rope-scaling", action="store_true", help="Llama-3.1's RoPE frequency scaling")
    g.add_argument("--rope-scaling-factor", type=positive_float, default=8.0, help="with --use-rope-scaling")
    # Megatron-LM's legacy position-embedding aliases, as it reads them.
    g.add_argument("--use-rotary-position-embeddings", action="store_true",
                   help="= --position-embedding-type rope (deprecated upstream)")
    g.add_argument("--no-position-embedding", dest="add_position_embedding", action="store_false",
                   help="accepted with rope (deprecated upstream: use --position-embedding-type)")
    g.add_argument("--recompute-activations", action="store_true",
                   help="selective activation recompute (= --recompute-granularity selective)")
    g.add_argument("--calculate-per-token-loss", action="store_true",
                   help="Megatron-LM's per-token loss: gradients averaged over the step's tokens, not per micro-batch")


def _add_rope_bias_and_vocab(p) -> None:
    g = p.add_argument_group("RoPE variants, biases, norms and vocabulary (Megatron-LM)")
    g.add_argument("--rope-type", choices=["rope", "yarn"], default=None,
                   help="default: yarn with --multi-latent-attention, else rope")
    g.add_argument("--rotary-interleaved", action="store_true", help="rotate interleaved pairs, not halves")
    g.add_argument("--yarn-original-max-position-embeddings", type=positive_int, default=None,
                   help="with --position-embedding-type yarn: the context the model was trained at (default 4096)")
    g.add_argument("--yarn-beta-fast", type=finite, default=None, help="with yarn: default 32")
    g.add_argument("--yarn-beta-slow", type=finite, default=None, help="with yarn: default 1")
    g.add_argument("--yarn-correction-range-round-to-int", action="store_true", default=None,
                   help="with yarn: round the correction range to integers (the default)")
    g.add_argument("--no-yarn-correction-range-round-to-int", dest="yarn_correction_range_round_to_int",
                   action="store_false", help="with yarn: leave the correction range unrounded")
    g.add_argument("--rotary-seq-len-interpolation-factor", type=positive_int, default=None,
                   help="divide the RoPE positions by this (linear position interpolation)")
    g.add_argument("--no-rope-freq", type=layer_pattern, default=None,
                   help="N: every N-th layer skips RoPE; or a 0/1 pattern per layer (1: no RoPE)")
    g.add_argument("--add-qkv-bias", action="store_true",
                   help="biases in the QKV projection only (Qwen2.5 with --disable-bias-linear)")
    g.add_argument("--norm-epsilon", type=positive_float, default=1e-5, help="epsilon of the layer norms")
    g.add_argument("--attention-softmax-in-fp32", action="store_true",
                   help="accepted: megatron-core's attention here always takes the softmax in fp32")
    g.add_argument("--padded-vocab-size", type=positive_int, default=None,
                   help="the embedding's rows as given, instead of padding the tokenizer's size")
    # Model-optimizer's export flags (Megatron-LM's post_training): refused in validate_rope_bias_and_vocab.
    g.add_argument("--export-qk-l2-norm", action="store_true", help="not supported: a model-optimizer export flag")
    g.add_argument("--export-moe-apply-probs-on-input", action="store_true",
                   help="not supported: a model-optimizer export flag")


def _add_kernels(p) -> None:
    g = p.add_argument_group("kernels: attention backend, fusions, FP8 (on where available)")
    g.add_argument("--transformer-impl", choices=["local", "transformer_engine"], default=None,
                   help="default: transformer_engine where it is installed and the run is on CUDA, else local")
    g.add_argument("--attention-backend", choices=["auto", "local", "flash", "fused", "unfused"], default="auto",
                   help="with transformer-engine layers, its kernels; without them flash and auto run torch's "
                        "scaled_dot_product_attention, local and unfused megatron-core's unfused attention")
    g.add_argument("--use-flash-attn", action="store_true", help="= --attention-backend flash")
    g.add_argument("--no-masked-softmax-fusion", dest="masked_softmax_fusion", action="store_false",
                   help="no fused scaled-masked softmax (default: on with CUDA and transformer-engine or apex)")
    g.add_argument("--no-bias-gelu-fusion", dest="bias_gelu_fusion", action="store_false",
                   help="no fused bias + GeLU (default: on with CUDA and linear biases)")
    g.add_argument("--no-bias-swiglu-fusion", dest="bias_swiglu_fusion", action="store_false",
                   help="no fused bias + SwiGLU with --swiglu (default: on with CUDA and linear biases)")
    g.add_argument("--no-bias-dropout-fusion", dest="bias_dropout_fusion", action="store_false",
                   help="no fused bias + dropout + residual add (default: on with CUDA)")
    g.add_argument("--no-rope-fusion", dest="apply_rope_fusion", action="store_false",
                   help="no fused RoPE (default: on with transformer-engine layers and rope)")
    g.add_argument("--no-gradient-accumulation-fusion", dest="gradient_accumulation_fusion", action="store_false",
                   help="no fused weight-gradient accumulation (default: on with CUDA and apex's kernel)")
    g.add_argument("--no-persist-layer-norm", action="store_true",
                   help="no persistent layer-norm kernel (default: on with CUDA and transformer-engine or apex)")
    g.add_argument("--cross-entropy-loss-fusion", action="store_true",
                   help="megatron-core's fused vocab-parallel cross entropy (CUDA; off on a CPU run)")
    g.add_argument("--fp8-format", choices=["e4m3", "hybrid"], default=None, help="needs transformer-engine on CUDA")
    g.add_argument("--fp8-recipe", choices=["tensorwise", "delayed", "mxfp8", "blockwise"], default=None,
                   help="with --fp8-format: transformer-engine's FP8 scaling recipe. Default: megatron-core's, delayed")
    g.add_argument("--fp8-margin", type=int, default=0,
                   help="with --fp8-format: the FP8 scale is divided by 2^margin for headroom. Default: %(default)s")
    g.add_argument("--fp8-amax-history-len", type=positive_int, default=1,
                   help="with --fp8-format: past amax values the scale is computed from. Default: %(default)s")
    g.add_argument("--fp8-amax-compute-algo", choices=["most_recent", "max"], default="most_recent",
                   help="with --fp8-format: scale from the largest amax of the history (max) or the latest one. "
                        "Default: %(default)s")
    g.add_argument("--fp8-param-gather", action="store_true",
                   help="with --fp8-format: keep the GEMM weights in FP8 and all-gather them in FP8")


def _add_training(p) -> None:
    g = p.add_argument_group("training (Megatron-LM)")
    g.add_argument("--train-samples", type=positive_int, default=None,
                   help="train for this many samples instead of --train-iters")
    g.add_argument("--step-batch-size-schedule", type=str, default=None, metavar="'THRESHOLD:BS ...'",
                   help="not supported: megatron-core 0.16.1 has no step-wise batch calculator")
    g.add_argument("--rampup-batch-size", nargs=3, type=positive_int, default=None,
                   metavar=("START", "INCREMENT", "SAMPLES"),
                   help="grow the global batch from START by INCREMENT over SAMPLES samples")
    g.add_argument("--eod-mask-loss", action="store_true", help="no loss on end-of-document tokens")
    g.add_argument("--reset-position-ids", action="store_true",
                   help="position ids restart after each end-of-document token (--data-path data)")
    g.add_argument("--reset-attention-mask", action="store_true",
                   help="not built: a mask per document, which the causal attention here does not take")
    g.add_argument("--dataloader-type", default="single",
                   type=only("single", "Megatron-LM's pretraining sampler: in order, resumed from the consumed samples"),
                   help="single only: Megatron-LM's pretraining sampler, in order, resumed from the consumed "
                        "samples (its cyclic and external are not built). Default: %(default)s")
    g.add_argument("--num-dataset-builder-threads", type=positive_int, default=1,
                   help="threads megatron-core's dataset builder builds the blend's indices on. Default: %(default)s")
    g.add_argument("--grad-reduce-in-bf16", action="store_true",
                   help="with --bf16, reduce gradients in bf16 (default: accumulate and reduce in fp32)")
    g.add_argument("--accumulate-allreduce-grads-in-fp32", action="store_true",
                   help="accumulate and reduce gradients in fp32: what --bf16 does unless --grad-reduce-in-bf16, and "
                        "fp32 training always; not with --fp16")
    g.add_argument("--no-check-for-nan-in-loss-and-grad", dest="check_for_nan_in_loss_and_grad",
                   action="store_false",
                   help="go on past a NaN or infinite loss or gradient (default: stop, naming the iteration; "
                        "with --fp16 the loss scaler skips such steps either way)")
    g.add_argument("--manual-gc", action="store_true",
                   help="disable Python's automatic GC; collect every --manual-gc-interval iterations")
    g.add_argument("--manual-gc-interval", type=non_negative_int, default=0,
                   help="with --manual-gc: collect every N iterations (0: never while training). Default: %(default)s")
    g.add_argument("--empty-unused-memory-level", type=int, choices=[0, 1, 2], default=0,
                   help="empty the CUDA cache after the step (1) and after forward-backward too (2)")
    g.add_argument("--deterministic-mode", action="store_true",
                   help="the same command gives the same bits run after run and across a resume: deterministic "
                        "torch kernels, SDPA without cuDNN, one NCCL algorithm; slower (docs/user_guide.md)")
    g.add_argument("--distributed-timeout-minutes", type=positive_int, default=10,
                   help="timeout of the process group's collectives")
    g.add_argument("--profile", action="store_true",
                   help="torch.profiler over iterations --profile-step-start..--profile-step-end")
    g.add_argument("--use-pytorch-profiler", action="store_true", help="accepted: --profile uses torch.profiler")
    g.add_argument("--profile-step-start", type=non_negative_int, default=10,
                   help="with --profile: profiling starts after this many iterations. Default: %(default)s")
    g.add_argument("--profile-step-end", type=non_negative_int, default=12,
                   help="with --profile: the last iteration profiled. Default: %(default)s")
    g.add_argument("--profile-ranks", nargs="+", type=non_negative_int, default=[0],
                   help="with --profile: the global ranks that profile. Default: rank 0")
    g.add_argument("--profile-dir", default=None,
                   help="with --profile: write each profiling rank's trace (Chrome's trace format, every thread's "
                        "operators) to DIR/profile_rank<R>.json. Default: --tensorboard-dir; without either, "
                        "print the ten busiest operators")


def _add_scheduler(p) -> None:
    g = p.add_argument_group("learning-rate and weight-decay schedule (Megatron-LM)")
    g.add_argument("--lr-warmup-fraction", type=fraction, default=None,
                   help="warmup as a fraction of the decay length")
    g.add_argument("--lr-warmup-samples", type=non_negative_int, default=0,
                   help="with --train-samples: samples of linear warmup from --lr-warmup-init to --lr. "
                        "Default: %(default)s")
    g.add_argument("--lr-decay-samples", type=positive_int, default=None,
                   help="with --train-samples: samples until the decay ends, warmup included. Default: --train-samples")
    g.add_argument("--lr-warmup-init", type=non_negative_float, default=0.0,
                   help="the learning rate the warmup starts from. Default: %(default)s")
    g.add_argument("--lr-wsd-decay-style", choices=["exponential", "linear", "cosine", "minus_sqrt"],
                   default="exponential",
                   help="with --lr-decay-style WSD: the shape of its final decay. Default: %(default)s")
    g.add_argument("--lr-wsd-decay-iters", type=positive_int, default=None,
                   help="with --lr-decay-style WSD: iterations of the final decay (held at --lr before it)")
    g.add_argument("--lr-wsd-decay-samples", type=positive_int, default=None,
                   help="with --lr-decay-style WSD and --train-samples: samples of the final decay")
    g.add_argument("--start-weight-decay", type=non_negative_float, default=None,
                   help="with --weight-decay-incr-style linear or cosine: the weight decay at the start")
    g.add_argument("--end-weight-decay", type=non_negative_float, default=None,
                   help="with --weight-decay-incr-style linear or cosine: the weight decay at the end")
    g.add_argument("--weight-decay-incr-style", choices=["constant", "linear", "cosine"], default="constant",
                   help="weight decay from --start- to --end-weight-decay over training; constant: --weight-decay. "
                        "Default: %(default)s")
    g.add_argument("--decoupled-lr", type=non_negative_float, default=None,
                   help="learning rate of the input and output embeddings")
    g.add_argument("--decoupled-min-lr", type=non_negative_float, default=None,
                   help="with --decoupled-lr: the embeddings' minimum learning rate. Default: --min-lr")


def _add_parallelism(p) -> None:
    g = p.add_argument_group("parallelism (Megatron-LM)")
    g.add_argument("--context-parallel-size", type=positive_int, default=1,
                   help="ranks each sequence would be split over; only 1 runs here, larger values are refused. "
                        "Default: %(default)s")
    virtual_pipeline.add_flags(g)
    uneven_pipeline.add_flags(g)


def validate_model(parser, args) -> None:
    """Sizes as Megatron-LM derives them; runs before the core checks that use them."""
    if args.use_rotary_position_embeddings:
        args.position_embedding_type = "rope"
    if not args.add_position_embedding and args.position_embedding_type != "rope":
        parser.error("argument --no-position-embedding: deprecated in Megatron-LM, which accepts it only with "
                     "rope; use --position-embedding-type rope")
    if args.step_batch_size_schedule is not None:
        parser.error("argument --step-batch-size-schedule: needs megatron-core's step-wise batch-size calculator, "
                     "absent from megatron-core 0.16.1 that this runs on; use --rampup-batch-size START INCREMENT "
                     "SAMPLES (a linear ramp) or a constant --global-batch-size")
    if args.recompute_activations:
        if args.recompute_granularity not in (None, "selective"):
            parser.error("argument --recompute-activations: not allowed with --recompute-granularity "
                         f"{args.recompute_granularity} (it means selective)")
        args.recompute_granularity = "selective"
    if args.kv_channels is None:
        if args.hidden_size % args.num_attention_heads:
            parser.error("argument --num-attention-heads: must divide --hidden-size "
                         f"({args.hidden_size} % {args.num_attention_heads} != 0) unless --kv-channels is given")
        args.kv_channels = default_kv_channels(args.hidden_size, args.num_attention_heads)
    if args.ffn_hidden_size is None:
        args.ffn_hidden_size = default_ffn_hidden_size(args.hidden_size, args.swiglu)
        if args.ffn_hidden_size == 0:
            parser.error(f"argument --swiglu: the default FFN size int(8*{args.hidden_size}/3/64)*64 is 0 for "
                         f"--hidden-size {args.hidden_size}; give --ffn-hidden-size")
    if not args.group_query_attention:
        args.num_query_groups = None  # Megatron-LM ignores --num-query-groups without --group-query-attention
    elif args.num_query_groups is None:
        args.num_query_groups = 1  # Megatron-LM's default: one KV head


def validate(parser, args) -> None:
    """Everything else: runs after the core checks. What the hardware lacks is named first."""
    optional_kernels.resolve(args, optional_kernels.Kernels.detect(args.device), parser.error)
    _validate_training_length(parser, args)
    lr_schedule.validate(args, parser.error)
    if args.decoupled_min_lr is not None and args.decoupled_lr is None:
        parser.error("argument --decoupled-min-lr: requires --decoupled-lr")
    if args.context_parallel_size > 1:
        # megatron-core's context parallelism (keys and values exchanged across the context group) runs
        # only in transformer-engine's attention; its unfused attention and torch's SDPA have none.
        missing = optional_kernels.Kernels.detect(args.device).missing_te()
        why = (f"needs transformer-engine's attention on CUDA (megatron-core's unfused attention and torch's "
               f"scaled_dot_product_attention have no context-parallel exchange), and {missing}" if missing else
               "not supported by this training layer yet (context-sharded batches)")
        parser.error(f"argument --context-parallel-size {args.context_parallel_size}: {why}; use 1")
    virtual_pipeline.validate(parser, args)
    if args.reset_attention_mask:
        parser.error("argument --reset-attention-mask: not built here: it needs an attention mask per document, "
                     "and the attention here (megatron-core's local layers, torch's SDPA) runs causal masks only")
    if args.reset_position_ids and args.mock_data:
        parser.error("argument --reset-position-ids: the --mock-data samples have no end-of-document tokens to "
                     "restart at; give --data-path")
    if args.accumulate_allreduce_grads_in_fp32 and (args.fp16 or args.grad_reduce_in_bf16):
        parser.error("argument --accumulate-allreduce-grads-in-fp32: not allowed with "
                     f"{'--fp16' if args.fp16 else '--grad-reduce-in-bf16'} (with --bf16 the gradients accumulate "
                     "and reduce in fp32 by default)")
    if args.grad_reduce_in_bf16 and not args.bf16:
        args.grad_reduce_in_bf16 = False  # only meaningful with bf16, as in Megatron-LM
    if args.profile_dir and not args.profile:
        parser.error("argument --profile-dir: only with --profile")
    if args.profile and args.profile_step_end <= args.profile_step_start:
        parser.error(f"argument --profile-step-end: {args.profile_step_end} must be above "
                     f"--profile-step-start {args.profile_step_start}")


def validate_rope_bias_and_vocab(parser, args) -> None:
    """Megatron-LM's derivation (a linear bias implies the QKV bias) and megatron-core's checks."""
    for flag in ("--export-qk-l2-norm", "--export-moe-apply-probs-on-input"):
        if getattr(args, flag[2:].replace("-", "_")):
            parser.error(f"argument {flag}: a model-optimizer export flag (Megatron-LM's post_training), not "
                         "a pretraining one; drop it")
    if not args.disable_bias_linear:
        args.add_qkv_bias = True
    if args.padded_vocab_size is not None and args.padded_vocab_size % args.tensor_model_parallel_size:
        parser.error(f"argument --padded-vocab-size: {args.padded_vocab_size} must be a multiple of "
                     f"--tensor-model-parallel-size {args.tensor_model_parallel_size} (each rank holds equal rows)")
    kind = args.position_embedding_type
    if kind in ("mrope", "relative"):
        parser.error(f"argument --position-embedding-type {kind}: "
                     + ("multimodal RoPE needs a vision-language model's --mrope-section" if kind == "mrope" else
                        "relative position buckets are T5's") + "; megatron-core's GPT here takes learned_absolute, "
                     "rope, yarn or none")
    if kind == "yarn" and args.multi_latent_attention:
        parser.error("argument --position-embedding-type yarn: multi-latent attention applies its own RoPE "
                     "(YaRN unless --rope-type rope); use --position-embedding-type rope")
    rope = kind in ("rope", "yarn") or args.multi_latent_attention
    for flag, given in (("--rotary-interleaved", args.rotary_interleaved),
                        ("--rotary-seq-len-interpolation-factor", args.rotary_seq_len_interpolation_factor),
                        ("--no-rope-freq", args.no_rope_freq is not None)):
        if given and not rope:
            parser.error(f"argument {flag}: requires --position-embedding-type rope or yarn")
    if args.rotary_interleaved and kind == "yarn":
        parser.error("argument --rotary-interleaved: megatron-core's YaRN embedding rotates halves only; use "
                     "--position-embedding-type rope")
    if args.rotary_interleaved and args.apply_rope_fusion:
        parser.error("argument --rotary-interleaved: megatron-core's fused RoPE rotates halves; add --no-rope-fusion")
    freq = args.no_rope_freq
    if isinstance(freq, int) and args.num_layers % freq:
        parser.error(f"argument --no-rope-freq: {freq} must divide --num-layers {args.num_layers}")
    if isinstance(freq, list) and len(freq) != args.num_layers:
        parser.error(f"argument --no-rope-freq: the pattern has {len(freq)} entries, --num-layers is "
                     f"{args.num_layers}")
    if freq is not None and args.multi_latent_attention:
        parser.error("argument --no-rope-freq: megatron-core's multi-latent attention rotates every layer")


def _validate_training_length(parser, args) -> None:
    if args.train_iters is None and args.train_samples is None:
        parser.error("argument --train-iters: give --train-iters or --train-samples")
    if args.train_iters is not None and args.train_samples is not None:
        parser.error("argument --train-samples: not allowed with --train-iters")
