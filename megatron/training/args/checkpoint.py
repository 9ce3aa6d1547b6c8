"""Megatron-LM's checkpoint flags (same names and meanings) and their checks, and the model shape
taken from a checkpoint's saved args with --use-checkpoint-args."""

from __future__ import annotations

import os

from megatron.training.checkpoint.saved_args import (FILLED_IF_MISSING, MODEL_SHAPE_ARGS, apply_model_shape,
                                                     read_saved_args)
from megatron.training.errors import positive_int

CKPT_FORMATS = ("torch_dist", "torch", "torch_dcp", "fsdp_dtensor")
NON_PERSISTENT_TYPES = ("global", "local", "in_memory")  # Megatron-LM's choices; global is built here


def add_flags(g) -> None:
    """Megatron-LM's checkpoint flags, same names and meanings (kept together at the group's end)."""
    g.add_argument("--no-load-optim", action="store_true",
                   help="load weights (and scheduler, iteration, data position) but not the optimizer state")
    g.add_argument("--no-load-rng", action="store_true", help="do not restore the saved RNG states")
    g.add_argument("--finetune", action="store_true",
                   help="load weights only: iteration, data position, scheduler, optimizer and RNG start fresh")
    g.add_argument("--no-save-optim", action="store_true", help="save no optimizer state (and no scheduler)")
    g.add_argument("--no-save-rng", action="store_true", help="save no RNG states")
    g.add_argument("--ckpt-format", choices=CKPT_FORMATS, default="torch_dist",
                   help="torch_dist (megatron-core dist_checkpointing) is the one supported here")
    g.add_argument("--auto-detect-ckpt-format", action="store_true",
                   help="read the format of the checkpoint in --load from its files instead of --ckpt-format")
    g.add_argument("--use-checkpoint-args", action="store_true",
                   help="take the model's shape (layers, sizes, heads, vocab, ...) from the args saved in --load")
    g.add_argument("--async-save", action="store_true",
                   help="write the torch_dist files and the offloaded optimizer state in the background "
                        "(training pauses only where an update overtakes the writer beyond "
                        "--offload-save-staging-gb); a checkpoint is completed (proof, tracker) once every "
                        "rank's writes have ended")
    g.add_argument("--use-persistent-ckpt-worker", action="store_true",
                   help="with --async-save: the torch_dist files of every save are written by one worker process "
                        "made at start-up, instead of by a process forked at each save; each save copies the "
                        "tensors into host memory both map (a staging the size of the rank's torch_dist "
                        "tensors, made at start-up and kept)")
    g.add_argument("--ckpt-convert-memory-mb", type=positive_int, default=512,
                   help="host memory the optimizer state may take at once while it is converted between the "
                        "offloaded form and megatron-core's own (at load time, or tools/convert_offload_checkpoint.py)")
    g.add_argument("--no-resume-check", dest="resume_check", action="store_false",
                   help="record no digests of each rank's params and offloaded optimizer state at a save, and "
                        "compare none at a load (the resume check, whose digests take CPU time beside the "
                        "checkpoint writer and the load)")
    g.add_argument("--no-ckpt-read-ahead", dest="ckpt_read_ahead", action="store_false",
                   help="at a load, read nothing ahead: by default a few threads of each node read its ranks' "
                        "torch_dist files into the page cache in large pieces while megatron-core reads them item "
                        "by item (skipped where they exceed half of the node's available memory)")
    g.add_argument("--ckpt-fully-parallel-save", dest="ckpt_fully_parallel_save", action="store_true",
                   default=True, help="spread the writing of replicated shards over data-parallel ranks (default)")
    g.add_argument("--no-ckpt-fully-parallel-save", dest="ckpt_fully_parallel_save", action="store_false",
                   help="write each replicated shard from one data-parallel rank (default: spread over the ranks)")
    g.add_argument("--ckpt-fully-parallel-load", action="store_true",
                   help="each data-parallel rank reads a part of the replicated shards and they exchange them")
    g.add_argument("--non-persistent-save-interval", type=positive_int, default=None,
                   help="with --non-persistent-ckpt-type global: also save every N iterations into a directory that "
                        "keeps only its newest complete checkpoint (--non-persistent-global-ckpt-dir); a resume "
                        "takes the newer of it and --load's. Default: none")
    g.add_argument("--non-persistent-ckpt-type", choices=NON_PERSISTENT_TYPES, default=None,
                   help="global: the non-persistent checkpoints are ordinary ones (torch_dist and the offloaded "
                        "state) in their own directory, the only kind built here (Megatron-LM's local and "
                        "in_memory are not). Default: none")
    g.add_argument("--non-persistent-global-ckpt-dir", type=str, default=None,
                   help="where --non-persistent-ckpt-type global saves and looks for its checkpoints. Default: "
                        "non_persistent/ in --save (and in --load, for a resume)")
    # Megatron-LM's deprecated spellings, no-ops there too: its scripts still pass them.
    g.add_argument("--use-dist-ckpt", dest="use_dist_ckpt_deprecated", action="store_true",
                   help="deprecated in Megatron-LM, no effect: --ckpt-format chooses the format")
    g.add_argument("--dist-ckpt-format", dest="dist_ckpt_format_deprecated", default=None,
                   help="deprecated in Megatron-LM, no effect: --ckpt-format chooses the format")


def validate(parser, args) -> None:
    for flag, given in (("--use-dist-ckpt", args.use_dist_ckpt_deprecated),
                        ("--dist-ckpt-format", args.dist_ckpt_format_deprecated)):
        if given and os.environ.get("RANK", "0") == "0":
            print(f"> {flag} is deprecated (as in Megatron-LM) and has no effect: --ckpt-format {args.ckpt_format} "
                  "chooses the format", flush=True)
    if args.ckpt_format != "torch_dist":
        parser.error(f"argument --ckpt-format: {args.ckpt_format} is not supported here; use torch_dist "
                     f"(megatron-core dist_checkpointing, Megatron-LM's default)")
    for flag, given in (("--use-checkpoint-args", args.use_checkpoint_args), ("--finetune", args.finetune),
                        ("--auto-detect-ckpt-format", args.auto_detect_ckpt_format),
                        ("--ckpt-fully-parallel-load", args.ckpt_fully_parallel_load)):
        if given and not args.load:
            parser.error(f"argument {flag}: requires --load DIR")
    if args.async_save and not args.save:
        parser.error("argument --async-save: requires --save DIR")
    if args.use_persistent_ckpt_worker and not args.async_save:
        parser.error("argument --use-persistent-ckpt-worker: requires --async-save (a synchronous save writes from "
                     "the rank itself)")
    if args.non_persistent_ckpt_type in ("local", "in_memory"):
        parser.error(f"argument --non-persistent-ckpt-type: {args.non_persistent_ckpt_type} is Megatron-LM's, not "
                     "built here; global (ordinary checkpoints in --non-persistent-global-ckpt-dir) is")
    if args.non_persistent_save_interval is not None:
        if not args.save:
            parser.error("argument --non-persistent-save-interval: requires --save DIR")
        if args.non_persistent_ckpt_type != "global":
            parser.error("argument --non-persistent-save-interval: requires --non-persistent-ckpt-type global")
    if args.non_persistent_global_ckpt_dir and args.non_persistent_ckpt_type != "global":
        parser.error("argument --non-persistent-global-ckpt-dir: requires --non-persistent-ckpt-type global")
    if args.non_persistent_global_ckpt_dir and args.save and (
            os.path.abspath(args.non_persistent_global_ckpt_dir) == os.path.abspath(args.save)):
        parser.error(f"argument --non-persistent-global-ckpt-dir: {args.non_persistent_global_ckpt_dir} is --save "
                     "itself; it keeps only its newest checkpoint, so it needs a directory of its own")


def take_model_shape_from_checkpoint(parser, args) -> None:
    changed = apply_model_shape(args, read_saved_args(args.load))
    missing = [name for name in MODEL_SHAPE_ARGS + FILLED_IF_MISSING
               if name in ("num_layers", "hidden_size", "num_attention_heads", "seq_length")
               and getattr(args, name) is None]
    if missing:
        parser.error(f"argument --use-checkpoint-args: the checkpoint in --load {args.load} does not give "
                     f"--{missing[0].replace('_', '-')}; pass it on the command line")
    args.model_args_from_checkpoint = changed
