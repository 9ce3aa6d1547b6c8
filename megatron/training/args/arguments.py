"""Command-line arguments in Megatron-LM flag style.

``parse_args(argv)`` returns an ``argparse.Namespace``. Syntax and cross-flag consistency are
checked here, and every error goes through ``parser.error``, which raises ``UserError`` (one line
naming the flag, printed once per job by ``errors.reported_once``, exit status 2). The offload
flags are ``args/offload.py``'s, Megatron-LM's own groups ``args/megatron.py``'s (MoE: ``args/moe.py``).
"""

from __future__ import annotations

import argparse
import re
import sys
from typing import List, Optional

from megatron.training.args import (checkpoint as arguments_checkpoint, megatron as arguments_megatron,
                                    moe as arguments_moe, offload as arguments_offload)
from megatron.training.args import mla as arguments_mla
from megatron.training.runtime import optional_packages
from megatron.training.model import precision_aware, uneven_pipeline
from megatron.training.checkpoint.saved_args import FILLED_IF_MISSING, MODEL_SHAPE_ARGS
from megatron.training.errors import UserError, finite, non_negative_float, non_negative_int, positive_int
from megatron.training.flag_types import only

class _Parser(argparse.ArgumentParser):
    def error(self, message):
        raise UserError(message)


# argparse lists a parser's options and groups only in private attributes: these are the one place that
# reads them (tests/unit/test_private_reads.py names each).
def declared_actions(parser: argparse.ArgumentParser) -> list:
    """Every option and positional ``parser`` declares, argparse's own -h/--help included, in order."""
    return list(parser._actions)


def declared_groups(parser: argparse.ArgumentParser) -> list:
    """``(group, its actions)`` for each argument group of ``parser``, in the order --help shows them."""
    return [(group, list(group._group_actions)) for group in parser._action_groups]


def is_help(action: argparse.Action) -> bool:
    """Whether ``action`` is argparse's own -h/--help."""
    return isinstance(action, argparse._HelpAction)


def build_parser() -> argparse.ArgumentParser:
    p = _Parser(description="Megatron-style GPT pretraining on megatron-core", allow_abbrev=False)

    g = p.add_argument_group("model")
    g.add_argument("--num-layers", type=positive_int, required=True, help="transformer layers in the model")
    g.add_argument("--hidden-size", type=positive_int, required=True,
                   help="width of the hidden states and the embeddings")
    g.add_argument("--ffn-hidden-size", type=positive_int, default=None,
                   help="default 4*hidden; with --swiglu int(8*hidden/3/64)*64, as Megatron-LM")
    g.add_argument("--num-attention-heads", type=positive_int, required=True, help="attention heads per layer")
    g.add_argument("--num-query-groups", type=positive_int, default=None,
                   help="KV heads with --group-query-attention (default 1); ignored without it, as Megatron-LM")
    g.add_argument("--seq-length", type=positive_int, required=True, help="tokens per training sample")
    g.add_argument("--max-position-embeddings", type=positive_int, default=None,
                   help="longest sequence the position embeddings cover; at least --seq-length. Default: --seq-length")
    g.add_argument("--normalization", choices=["LayerNorm", "RMSNorm"], default="LayerNorm",
                   help="the layers' norm. Default: %(default)s")
    g.add_argument("--swiglu", action="store_true",
                   help="gated SiLU (SwiGLU) MLP instead of GeLU; changes the default --ffn-hidden-size")
    g.add_argument("--position-embedding-type", choices=["learned_absolute", "rope", "yarn", "none", "mrope", "relative"],
                   default="learned_absolute", help="Megatron-LM's choices; mrope and relative are refused")
    g.add_argument("--rotary-base", type=int, default=10000, help="RoPE's base (theta). Default: %(default)s")
    g.add_argument("--untie-embeddings-and-output-weights", action="store_true",
                   help="give the output layer its own weights instead of the input embedding's")
    g.add_argument("--disable-bias-linear", action="store_true",
                   help="no biases in the linear layers (a QKV bias only with --add-qkv-bias)")
    g.add_argument("--hidden-dropout", type=non_negative_float, default=0.1,
                   help="dropout probability on the attention and MLP outputs. Default: %(default)s")
    g.add_argument("--attention-dropout", type=non_negative_float, default=0.1,
                   help="dropout probability on the attention weights. Default: %(default)s")
    g.add_argument("--init-method-std", type=finite, default=0.02,
                   help="standard deviation of the weights' normal initialisation. Default: %(default)s")
    g.add_argument("--init-method-xavier-uniform", action="store_true",
                   help="the weights, embedding included (as Megatron-LM), drawn Xavier-uniform instead of normal "
                        "with --init-method-std")
    g.add_argument("--recompute-granularity", choices=["full", "selective"], default=None,
                   help="recompute whole layers (full) or only the attention core (selective) in backward. "
                        "Default: none")
    g.add_argument("--recompute-method", choices=["uniform", "block"], default=None,
                   help="with full recompute: uniform (all layers, in groups) or block (the first N of each stage). "
                        "Default: uniform")
    g.add_argument("--recompute-num-layers", type=positive_int, default=None,
                   help="with --recompute-granularity full: layers per group (uniform) or per stage (block). "
                        "Default: 1")

    g = p.add_argument_group("training")
    g.add_argument("--micro-batch-size", type=positive_int, required=True,
                   help="samples per forward and backward pass on each data-parallel rank")
    g.add_argument("--global-batch-size", type=positive_int, default=None,
                   help="samples per optimizer step over all ranks (gradient accumulation). "
                        "Default: micro-batch size x DP size")
    g.add_argument("--train-iters", type=positive_int, default=None, help="or --train-samples")
    g.add_argument("--seed", type=int, default=1234,
                   help="seeds Python, NumPy and torch (plus 100 per pipeline stage), the data order and --mock-data. "
                        "Default: %(default)s")
    g.add_argument("--bf16", action="store_true",
                   help="the model in bfloat16, with fp32 master weights and fp32 gradient reduction (default: fp32)")
    g.add_argument("--fp16", action="store_true",
                   help="the model and gradients in float16 with loss scaling and fp32 master weights (default: fp32)")
    g.add_argument("--loss-scale", type=finite, default=None, help="fp16 static loss scale")
    g.add_argument("--initial-loss-scale", type=finite, default=2.0**32,
                   help="with --fp16 and no --loss-scale: the dynamic loss scale's first value. Default: 2^32")
    g.add_argument("--min-loss-scale", type=finite, default=1.0,
                   help="with --fp16 and no --loss-scale: the dynamic loss scale never backs off below this. "
                        "Default: %(default)s")
    g.add_argument("--loss-scale-window", type=positive_int, default=1000,
                   help="with --fp16 and no --loss-scale: the scale doubles after this many steps without an "
                        "overflow. Default: %(default)s")
    g.add_argument("--hysteresis", type=positive_int, default=2,
                   help="with --fp16 and no --loss-scale: overflowing steps tolerated before the scale halves. "
                        "Default: %(default)s")
    g.add_argument("--tensor-model-parallel-size", type=positive_int, default=1,
                   help="ranks each layer's weights are split over (tensor parallelism). Default: %(default)s")
    g.add_argument("--pipeline-model-parallel-size", type=positive_int, default=1,
                   help="pipeline stages the layers are split into; must divide --num-layers. Default: %(default)s")
    g.add_argument("--sequence-parallel", action="store_true",
                   help="with TP > 1: split the norms' and dropouts' activations along the sequence too (off at TP 1)")
    g.add_argument("--use-distributed-optimizer", dest="use_distributed_optimizer",
                   action="store_true", default=None,
                   help="shard the optimizer state over data-parallel ranks; off by default as in Megatron-LM, "
                        "implied by --offload-tiers and --optimizer-cpu-offload")
    g.add_argument("--no-use-distributed-optimizer", dest="use_distributed_optimizer",
                   action="store_false",
                   help="keep the whole optimizer state on every data-parallel rank; not allowed with --offload-tiers")
    g.add_argument("--overlap-grad-reduce", action="store_true",
                   help="overlap the data-parallel gradient reduction with the backward pass, in buckets")
    g.add_argument("--overlap-param-gather", action="store_true",
                   help="with the distributed optimizer: overlap the updated params' all-gather with the next forward")
    g.add_argument("--device", choices=["cpu", "cuda", "auto"], default="auto",
                   help="cuda (LOCAL_RANK's GPU), cpu (gloo, no CUDA kernels) or auto: cuda if one is visible. "
                        "Default: %(default)s")

    g = p.add_argument_group("optimizer")
    g.add_argument("--optimizer", default="adam",
                   type=only("adam", "AdamW with decoupled weight decay, as Megatron-LM's adam, whose state the "
                                     "offload engine keeps"),
                   help="adam only: AdamW with decoupled weight decay, Megatron-LM's adam (its sgd, muon, lion and "
                        "soap are not built here). Default: %(default)s")
    g.add_argument("--lr", type=non_negative_float, required=True,
                   help="peak learning rate, reached after the warmup and decayed to --min-lr")
    g.add_argument("--min-lr", type=non_negative_float, default=0.0,
                   help="the learning rate the decay ends at. Default: %(default)s")
    g.add_argument("--lr-decay-style", choices=["constant", "linear", "cosine", "inverse-square-root", "WSD"],
                   default="linear",
                   help="how the learning rate falls from --lr to --min-lr after the warmup. Default: %(default)s")
    g.add_argument("--lr-decay-iters", type=positive_int, default=None,
                   help="iterations until the decay ends, warmup included. Default: --train-iters")
    g.add_argument("--lr-warmup-iters", type=non_negative_int, default=0,
                   help="iterations of linear warmup from --lr-warmup-init to --lr. Default: %(default)s")
    g.add_argument("--weight-decay", type=non_negative_float, default=0.01,
                   help="AdamW's decoupled weight decay (see --weight-decay-incr-style). Default: %(default)s")
    g.add_argument("--adam-beta1", type=finite, default=0.9,
                   help="Adam's decay rate of the first moment. Default: %(default)s")
    g.add_argument("--adam-beta2", type=finite, default=0.999,
                   help="Adam's decay rate of the second moment. Default: %(default)s")
    g.add_argument("--adam-eps", type=finite, default=1e-8, help="added to Adam's denominator. Default: %(default)s")
    g.add_argument("--clip-grad", type=non_negative_float, default=1.0,
                   help="clip the gradients' global L2 norm to this; 0 turns clipping off. Default: %(default)s")
    precision_aware.add_flags(g)

    g = p.add_argument_group("logging, evaluation, checkpoints")
    g.add_argument("--log-interval", type=positive_int, default=100,
                   help="print the iteration line (and timers) every N iterations and for the first of a run. "
                        "Default: %(default)s")
    g.add_argument("--eval-interval", type=positive_int, default=None,
                   help="validate every N iterations on --eval-iters batches. "
                        "Default: none, no validation (Megatron-LM: 1000)")
    g.add_argument("--eval-iters", type=non_negative_int, default=2,
                   help="global batches per validation. Default: %(default)s (Megatron-LM: 100)")
    g.add_argument("--save", type=str, default=None,
                   help="checkpoint directory: saved every --save-interval and at the end. "
                        "Default: none, no checkpoints")
    g.add_argument("--load", type=str, default=None,
                   help="checkpoint directory to resume from, at its latest complete checkpoint. Default: none")
    g.add_argument("--save-interval", type=positive_int, default=None,
                   help="with --save: also save every N iterations. Default: none, at the end only")
    g.add_argument("--save-retain-interval", type=positive_int, default=None,
                   help="keep the checkpoints at multiples of N iterations and the newest: once a checkpoint is "
                        "complete, the earlier ones in --save at other iterations are removed in the background "
                        "(a multiple of --save-interval; Megatron-LM's flag). Default: none, every checkpoint kept")
    g.add_argument("--exit-interval", type=positive_int, default=None,
                   help="stop (after saving, with --save) when the iteration is a multiple of this")
    g.add_argument("--exit-signal-handler", action="store_true",
                   help="on SIGTERM (SLURM's --signal, torchrun stopping), finish the iteration, save a complete "
                        "checkpoint (offloaded state included) and exit 0, as Megatron-LM does")
    g.add_argument("--exit-signal", choices=["SIGTERM", "SIGINT", "SIGUSR1", "SIGUSR2"], default="SIGTERM",
                   help="the signal --exit-signal-handler saves on; another than SIGTERM lets SLURM warn the ranks "
                        "without torchrun, which stops its workers 30 s after a SIGTERM (torch < 2.12)")
    g.add_argument("--exit-duration-in-mins", type=non_negative_float, default=None,
                   help="after this many minutes from the start, save and exit at the end of the iteration")
    g.add_argument("--loss-log", type=str, default=None,
                   help="JSONL file: one {iteration, loss, lr, grad_norm} line per iteration")
    g.add_argument("--timing-log", type=str, default=None, metavar="FILE",
                   help="JSONL file: one {iteration, elapsed_s, forward_backward_s, optimizer_s} line per "
                        "iteration (kept apart from --loss-log, whose records must repeat bit for bit)")
    # Megatron-LM's logging flags: the console line, its timers, TensorBoard and W&B.
    g.add_argument("--log-throughput", action="store_true",
                   help="print the model's TFLOP/s per GPU on the iteration line (Megatron-LM's FLOPs count)")
    g.add_argument("--log-params-norm", action="store_true", help="compute and log the parameters' L2 norm")
    g.add_argument("--log-num-zeros-in-grad", action="store_true",
                   help="count and log the zeros in the gradients (megatron-core's optimizer only)")
    g.add_argument("--timing-log-level", type=int, choices=[0, 1, 2], default=0,
                   help="megatron-core timers printed every --log-interval: 0 none, 1 the step's phases, "
                        "2 also the schedule's per-micro-batch compute and communication")
    g.add_argument("--timing-log-option", choices=["max", "minmax", "all"], default="minmax",
                   help="how the timers are reduced across ranks when printed")
    g.add_argument("--tensorboard-dir", type=str, default=None, help="write TensorBoard events here (last rank)")
    g.add_argument("--tensorboard-log-interval", type=positive_int, default=1,
                   help="write the iteration's scalars to TensorBoard and W&B every N iterations. Default: %(default)s")
    g.add_argument("--tensorboard-queue-size", type=positive_int, default=1000,
                   help="events held in memory before TensorBoard's writer flushes them to disk")
    g.add_argument("--log-timers-to-tensorboard", action="store_true",
                   help="also write iteration time, throughput and the --timing-log-level timers")
    g.add_argument("--no-log-loss-scale-to-tensorboard", dest="log_loss_scale_to_tensorboard",
                   action="store_false", default=True,
                   help="leave the loss scale out of the TensorBoard and W&B scalars (logged by default)")
    g.add_argument("--log-validation-ppl-to-tensorboard", action="store_true",
                   help="also write the validation perplexity (exp of the loss) to TensorBoard")
    g.add_argument("--log-memory-to-tensorboard", action="store_true",
                   help="device memory (CUDA) and the offload engine's bytes per tier")
    g.add_argument("--wandb-project", type=str, default=None,
                   help="log to Weights & Biases (last rank); WANDB_MODE=offline keeps it on disk")
    g.add_argument("--wandb-exp-name", type=str, default=None, help="name of the W&B run; needed with --wandb-project")
    g.add_argument("--wandb-save-dir", type=str, default=None,
                   help="the W&B run directory's parent; default SAVE/wandb")
    arguments_checkpoint.add_flags(g)

    g = p.add_argument_group("data")
    g.add_argument("--mock-data", action="store_true",
                   help="train on generated, learnable byte sequences instead of --data-path")
    g.add_argument("--data-path", nargs="+", default=None,
                   help="prefixes of .bin/.idx files, optionally weighted: [W1] P1 [W2] P2 ...")
    g.add_argument("--split", type=str, default="969,30,1",
                   help="train,valid,test weights over the --data-path documents (test is never read). "
                        "Default: %(default)s")
    g.add_argument("--train-data-path", nargs="+", default=None,
                   help="instead of --data-path and --split: the training data's own prefixes, [W1] P1 [W2] P2 ...")
    g.add_argument("--valid-data-path", nargs="+", default=None,
                   help="with --train-data-path: the validation data's own prefixes (none: no validation data)")
    g.add_argument("--test-data-path", nargs="+", default=None,
                   help="with --train-data-path: the test data's prefixes (taken as Megatron-LM does; never read)")
    from megatron.training.data.tokenizers import add_tokenizer_arguments

    add_tokenizer_arguments(g)  # --tokenizer-type, --vocab-size, --vocab-file, ... as Megatron-LM
    g.add_argument("--num-workers", type=non_negative_int, default=2,
                   help="DataLoader worker processes per rank (default 2, as Megatron-LM; 0 loads in the rank)")
    g.add_argument("--data-cache-path", type=str, default=None,
                   help="directory for the datasets' cached sample and shuffle indices. "
                        "Default: cache/ under each --data-path prefix")
    g.add_argument("--no-mmap-bin-files", dest="mmap_bin_files", action="store_false",
                   help="read the .bin files instead of memory-mapping them")
    g.add_argument("--no-create-attention-mask-in-dataloader", dest="create_attention_mask_in_dataloader",
                   action="store_false", help="accepted: the loader never builds masks here (causal attention)")

    arguments_offload.add_groups(p)
    arguments_megatron.add_groups(p)
    arguments_moe.add_flags(p)
    arguments_mla.add_flags(p)
    return p


def _validate(parser, args) -> None:
    if args.bf16 and args.fp16:
        parser.error("argument --fp16: not allowed with --bf16")
    arguments_megatron.validate_model(parser, args)
    if args.num_query_groups is not None and args.num_attention_heads % args.num_query_groups:
        parser.error("argument --num-query-groups: must divide --num-attention-heads")
    tp, pp = args.tensor_model_parallel_size, args.pipeline_model_parallel_size
    if args.num_attention_heads % tp:
        parser.error("argument --tensor-model-parallel-size: must divide --num-attention-heads")
    if args.num_query_groups is not None and args.num_query_groups % tp:
        parser.error("argument --tensor-model-parallel-size: must divide --num-query-groups")
    uneven_pipeline.validate(parser, args)  # --num-layers over the pipeline ranks, evenly or as the split flags say
    if args.sequence_parallel and tp == 1:
        args.sequence_parallel = False  # meaningless without TP, as in Megatron-LM
    if args.max_position_embeddings is None:
        args.max_position_embeddings = args.seq_length
    if args.seq_length > args.max_position_embeddings:
        parser.error("argument --seq-length: exceeds --max-position-embeddings")
    if args.min_lr > args.lr:
        parser.error("argument --min-lr: must be <= --lr")
    for flag, given in (("--valid-data-path", args.valid_data_path), ("--test-data-path", args.test_data_path)):
        if given and not args.train_data_path:
            parser.error(f"argument {flag}: requires --train-data-path")
    if args.train_data_path and args.data_path:
        parser.error("argument --train-data-path: not allowed with --data-path (the data of each split is given "
                     "by its own flag)")
    if args.mock_data == bool(args.data_path or args.train_data_path):
        parser.error("argument --data-path: give exactly one of --mock-data, --data-path or --train-data-path")
    if args.wandb_project and not args.wandb_exp_name:
        parser.error("argument --wandb-project: requires --wandb-exp-name NAME")
    if args.wandb_project and not (args.wandb_save_dir or args.save):
        parser.error("argument --wandb-project: requires --wandb-save-dir DIR (or --save DIR, whose wandb/ it uses)")
    if (args.save_interval is not None) and not args.save:
        parser.error("argument --save-interval: requires --save DIR")
    if args.save_retain_interval is not None:
        if not args.save_interval:
            parser.error("argument --save-retain-interval: requires --save DIR and --save-interval N")
        if args.save_retain_interval % args.save_interval:
            parser.error(f"argument --save-retain-interval: {args.save_retain_interval} is not a multiple of "
                         f"--save-interval {args.save_interval}")
    arguments_checkpoint.validate(parser, args)
    if args.recompute_method is not None and args.recompute_granularity != "full":
        parser.error("argument --recompute-method: requires --recompute-granularity full")
    if args.recompute_granularity == "full" and args.recompute_method is None:
        args.recompute_method = "uniform"
    if args.recompute_granularity == "full" and args.recompute_num_layers is None:
        args.recompute_num_layers = 1
    for flag, value in (("--adam-beta1", args.adam_beta1), ("--adam-beta2", args.adam_beta2)):
        if not 0.0 <= value < 1.0:
            parser.error(f"argument {flag}: must be in [0, 1), got {value}")
    for flag, value in (("--adam-eps", args.adam_eps), ("--init-method-std", args.init_method_std),
                        ("--loss-scale", args.loss_scale), ("--initial-loss-scale", args.initial_loss_scale),
                        ("--min-loss-scale", args.min_loss_scale)):
        if value is not None and not value > 0:
            parser.error(f"argument {flag}: must be > 0, got {value}")
    for flag, value in (("--hidden-dropout", args.hidden_dropout), ("--attention-dropout", args.attention_dropout)):
        if value > 1.0:
            parser.error(f"argument {flag}: must be in [0, 1], got {value}")
    try:
        split = [float(s) for s in re.split(r"[,/]", args.split)]
        assert len(split) <= 3 and sum(split) > 0 and min(split) >= 0
    except (ValueError, AssertionError):
        parser.error(f"argument --split: expected up to 3 non-negative weights like 969,30,1, got {args.split!r}")


def parse_args(argv: Optional[List[str]] = None) -> argparse.Namespace:
    parser = build_parser()
    from_checkpoint = "--use-checkpoint-args" in (argv if argv is not None else sys.argv[1:])
    if from_checkpoint:  # the model's shape comes from the checkpoint: its flags become optional
        for action in declared_actions(parser):
            if action.dest in MODEL_SHAPE_ARGS + FILLED_IF_MISSING:
                action.required = False
    args, rest = parser.parse_known_args(argv)
    args.offload_paths = arguments_offload.parse_offload_paths(parser, rest)
    if from_checkpoint and args.load:
        arguments_checkpoint.take_model_shape_from_checkpoint(parser, args)
    _validate(parser, args)
    arguments_megatron.validate(parser, args)
    arguments_moe.validate(parser, args)
    arguments_megatron.validate_rope_bias_and_vocab(parser, args)
    arguments_mla.validate(parser, args)
    arguments_offload.default_distributed_optimizer(parser, args)
    precision_aware.validate(parser, args)
    arguments_offload.validate(parser, args)
    optional_packages.check_flags(args)  # one line before any work, not an ImportError later
    return args
