"""Convert a checkpoint's optimizer state between the offloaded form and megatron-core's own.

    python tools/convert_offload_checkpoint.py --to plain   --load IN --save OUT [--max-memory-mb M] -- TRAINING_FLAGS...
    python tools/convert_offload_checkpoint.py --to offload --load IN --save OUT [--max-memory-mb M] -- TRAINING_FLAGS... --offload-...

TRAINING_FLAGS are the run's own (model, parallel sizes, precision, data): the plain form is keyed
by megatron-core's DDP buckets, so the model is built as training builds it. The tool launches
``pretrain_gpt.py`` on this node with ``--load IN --save OUT --train-iters <saved iteration>``: the
load converts (``checkpoint/crossing.py``, at any DP/TP/PP) and the save writes the other form, with
no training step in between. The state moves in pieces of at most --max-memory-mb (default 512)
beside what the target optimizer holds: both directions read only the ranges they need from the
source's files, never a rank's whole shard; the load's last line says how much memory it added.
"""

import argparse
import os
import subprocess
import sys

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

from megatron.training.checkpoint import integrity  # noqa: E402
from megatron.training.checkpoint.load_plan import saved_in_offloaded_form  # noqa: E402


def fail(line: str):
    raise SystemExit(f"error: {line}")


def saved_checkpoint(root: str):
    """(iteration, iteration dir, offloaded?, processes the saved layout ran) of the one --load resumes."""
    from megatron.core import dist_checkpointing

    if not os.path.isdir(root):
        fail(f"--load {root}: not a directory")
    try:
        iteration, _ = integrity.choose_checkpoint(root)
    except ValueError as err:
        fail(f"--load {root}: {err}")
    if iteration is None:
        fail(f"--load {root}: holds no complete checkpoint")
    path = integrity.checkpoint_dir(root, iteration)
    common = dist_checkpointing.load_common_state_dict(path)
    if "opt_param_scheduler" not in common:
        fail(f"--load {path}: holds no optimizer state (saved with --no-save-optim): nothing to convert")
    saved = common.get("args")
    world = getattr(saved, "world_size", None) if saved is not None else None
    return iteration, path, saved_in_offloaded_form(common), world


def main(argv=None) -> int:
    nproc, pretrain_args, message = plan_conversion(argv)
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(nproc),
               os.path.join(REPO, "pretrain_gpt.py"), *pretrain_args]
    print(f"{message}: {' '.join(command)}", flush=True)
    return subprocess.call(command, cwd=REPO)


def plan_conversion(argv=None):
    """Checks the tool's arguments and the checkpoint (one line on what is wrong); returns
    (processes, pretrain_gpt.py's arguments, a line saying what converts where): the load converts,
    the save at the end writes the other form."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--to", choices=("plain", "offload"), required=True)
    parser.add_argument("--load", required=True, help="checkpoint root to read (its latest complete iteration)")
    parser.add_argument("--save", required=True, help="checkpoint root to write (new or empty)")
    parser.add_argument("--nproc", type=int, help="processes on this node (default: the saved run's world size)")
    parser.add_argument("--max-memory-mb", type=int, default=None,
                        help="host memory per process for the state in flight (the training flag "
                             "--ckpt-convert-memory-mb; default 512)")
    parser.add_argument("training_flags", nargs=argparse.REMAINDER, help="after --: the run's training flags")
    args = parser.parse_args(argv)
    flags = args.training_flags[1:] if args.training_flags[:1] == ["--"] else args.training_flags
    if args.max_memory_mb is not None and args.max_memory_mb <= 0:
        fail(f"--max-memory-mb {args.max_memory_mb}: give a positive number of MB")
    iteration, path, offloaded, world = saved_checkpoint(args.load)
    if offloaded == (args.to == "offload"):
        fail(f"--load {path}: its optimizer state is already in the {args.to} form")
    if os.path.exists(args.save) and (not os.path.isdir(args.save) or os.listdir(args.save)):
        fail(f"--save {args.save}: exists and is not an empty directory; give a new one")
    for flag in ("--load", "--save", "--train-iters", "--no-load-optim", "--finetune", "--no-save-optim",
                 "--ckpt-convert-memory-mb"):
        if flag in flags:
            fail(f"{flag} among the training flags: the tool sets it" +
                 (" (give --max-memory-mb)" if flag == "--ckpt-convert-memory-mb" else ""))
    has_offload_flags = any(f.startswith("--offload-") for f in flags)
    if has_offload_flags != (args.to == "offload"):
        fail("--to offload needs the run's --offload-... flags after --" if args.to == "offload" else
             "--to plain: drop the --offload-... flags after --")
    nproc = args.nproc or world
    if not nproc:
        fail(f"--load {path}: the saved args give no world size; pass --nproc")
    pretrain_args = [*flags, "--load", args.load, "--save", args.save, "--train-iters", str(iteration),
                     *(["--ckpt-convert-memory-mb", str(args.max_memory_mb)] if args.max_memory_mb else []),
                     "--save-interval", str(iteration + 1)]  # the save at the end: not skipped as an interval's
    return nproc, pretrain_args, f"> converting {path} to the {args.to} form into {args.save}"


if __name__ == "__main__":
    sys.exit(main())
