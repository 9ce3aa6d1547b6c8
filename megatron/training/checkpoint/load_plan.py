"""What a load restores, decided before anything is read: which checkpoint (the newest complete one,
chosen by rank 0 for all), whether its format loads here, and what becomes of each kind of state it
holds, from the flags and its common state.

Only torch_dist (megatron-core dist_checkpointing, Megatron-LM's default) loads; a directory in
another of Megatron-LM's formats is refused with one line saying which it is. The optimizer state
loads in its own form, is converted between the offloaded and megatron-core's distributed-optimizer
forms (crossing), or is skipped (--no-load-optim, --finetune: the optimizer then starts from the
loaded weights). RNG states load where the checkpoint's (pp, tp, dp) layout is this run's: they are
per rank. The run resumes at the saved iteration and data position, or at 0 with --finetune.
``checkpointing.load_checkpoint`` then does what the plan says, one kind of state after the other.
"""

from __future__ import annotations

import glob
import os
from dataclasses import dataclass, field
from typing import List, Optional

import torch
from megatron.core import dist_checkpointing, parallel_state
from megatron.core.dist_checkpointing.core import maybe_load_config

from megatron.training.checkpoint import integrity
from megatron.training.errors import UserError
from megatron.training.runtime.optimizer_interface import OffloadedOptimizerCheckpoint
from megatron.training.runtime.progress import print_rank0

SAME_FORM, FROM_OFFLOADED, FROM_DISTRIBUTED = "same form", "from offloaded", "from distributed"


@dataclass
class LoadPlan:
    path: str  # the iter_N directory
    common: dict  # its common state: saved args, scheduler, the offloaded form's metadata, ...
    optimizer: Optional[str]  # SAME_FORM, FROM_OFFLOADED, FROM_DISTRIBUTED; None: weights only
    run_offloaded: bool
    scheduler: bool
    rng: bool  # whether the RNG states load (Megatron-LM's layout)
    resume: bool  # False with --finetune: the run starts at iteration 0 with no data consumed
    iteration: int  # where the run goes on (0 without resume)
    consumed_samples: int  # the data iterator's position (0 without resume)
    notes: List[str] = field(default_factory=list)

    @property
    def reads_offload_files(self) -> bool:
        return self.optimizer in (SAME_FORM, FROM_OFFLOADED) and saved_in_offloaded_form(self.common)

    @property
    def offload_meta(self) -> dict:
        """The offloaded form's common state (step count, grad scalers), where the optimizer reads it."""
        return self.common["optimizer"]["offload_meta"]

    @classmethod
    def make(cls, common: dict, path: str, optimizer, args) -> "LoadPlan":
        saved = common.get("args")
        run_offloaded = isinstance(optimizer, OffloadedOptimizerCheckpoint)
        ckpt_offloaded = saved_in_offloaded_form(common)
        has_optimizer = "opt_param_scheduler" in common  # saved together, as upstream
        wanted = not (args.no_load_optim or args.finetune)
        if wanted and not has_optimizer:
            raise UserError(f"--load {path}: the checkpoint holds no optimizer state (saved with --no-save-optim); "
                            f"pass --no-load-optim or --finetune to load its weights only")
        form = None
        if wanted:
            form = SAME_FORM if ckpt_offloaded == run_offloaded else (
                FROM_OFFLOADED if ckpt_offloaded else FROM_DISTRIBUTED)
        if form in (SAME_FORM, FROM_DISTRIBUTED) and not ckpt_offloaded:
            _check_plain_state_layout(common, saved, path)
        notes = [] if wanted else [f"loading the weights only ({'--finetune' if args.finetune else '--no-load-optim'})"]
        rng, why_not = _rng_plan(saved, args)
        if why_not:
            notes.append(why_not)
        resume = not args.finetune
        iteration, consumed = 0, 0
        if resume:
            iteration = common["iteration"]
            consumed = getattr(saved, "consumed_train_samples", 0)
        return cls(path, common, form, run_offloaded, wanted, rng, resume, iteration, consumed or 0, notes)


def plan_load(root: str, optimizer, args) -> Optional[LoadPlan]:
    """The plan for ``--load root``, the same on every rank (collective); None when it holds no
    checkpoint yet. The choice's and the plan's notes are printed by rank 0."""
    if not os.path.isdir(root):
        raise UserError(f"--load {root}: not a directory")
    iteration, notes = _choose(root)
    for note in notes:
        print_rank0(f"> {note}")
    if iteration is None:
        return None
    path = integrity.checkpoint_dir(root, iteration)
    check_format(path, args)
    plan = LoadPlan.make(dist_checkpointing.load_common_state_dict(path), path, optimizer, args)
    for note in plan.notes:
        print_rank0(f"> {note}")
    return plan


def resume_root(args) -> Optional[str]:
    """The directory a resume reads: --load, or the directory of --non-persistent-ckpt-type global's checkpoints
    where it holds a later complete one (rank 0 decides for all and says which); None where the run starts fresh:
    ``--save X --load X`` with neither X nor its non-persistent directory made yet (a batch chain's first job)."""
    non_persistent = integrity.non_persistent_root(args, args.load)
    if (args.load == args.save and not _is_dir_on_rank0(args.load)
            and not (non_persistent and _is_dir_on_rank0(non_persistent))):
        return None
    if non_persistent is None:
        return args.load
    choice = [None]
    if torch.distributed.get_rank() == 0:
        choice = [newer_checkpoint_root(args.load, non_persistent)]
    torch.distributed.broadcast_object_list(choice, src=0)
    root, note = choice[0]
    if note:
        print_rank0(f"> {note}")
    return root


def _is_dir_on_rank0(path: str) -> bool:
    """Whether ``path`` is a directory, as rank 0 saw it, on every rank: another rank may be creating
    it (a --tensorboard-dir inside --load), and a rank that decided otherwise would skip the load's
    collectives and hang the job."""
    seen = [os.path.isdir(path) if torch.distributed.get_rank() == 0 else None]
    torch.distributed.broadcast_object_list(seen, src=0)
    return bool(seen[0])


def newer_checkpoint_root(load: str, non_persistent: str):
    """(root, the line saying why or None): ``non_persistent`` where its newest complete checkpoint is later than
    ``load``'s, else ``load`` (also on a tie: the persistent one). A problem in the non-persistent directory is
    said and passed over; one in ``load`` is left for its load to report."""
    try:
        later, _ = integrity.choose_checkpoint(non_persistent)
    except ValueError as err:
        return load, f"--non-persistent-ckpt-type global: {non_persistent} not used: {err}"
    try:
        persistent, _ = integrity.choose_checkpoint(load) if os.path.isdir(load) else (None, [])
        older = f"--load's newest is at {persistent}" if persistent is not None else f"--load {load} holds none"
    except ValueError:
        persistent, older = None, f"--load {load} holds none usable"
    if later is None or (persistent is not None and persistent >= later):
        return load, None
    return non_persistent, (f"resuming from the non-persistent checkpoint at iteration {later} in {non_persistent} "
                            f"({older})")


def resume_position(plan: LoadPlan, args):
    """(iteration, consumed samples): where the loop and the data iterator start; the count of
    floating-point operations goes on from the saved one too (not with --finetune)."""
    if plan.resume:
        args.num_floating_point_operations_so_far = plan.common.get("num_floating_point_operations_so_far", 0)
    return plan.iteration, plan.consumed_samples


def detect_format(path: str) -> str:
    """'torch_dist', 'torch' (legacy mp_rank_XX files), 'torch_dcp', or 'unknown'."""
    config = maybe_load_config(path)
    if config is not None:
        return config.sharded_backend
    if glob.glob(os.path.join(path, "mp_rank_*")):
        return "torch"
    if os.path.exists(os.path.join(path, ".metadata")):
        return "torch_dcp"
    return "unknown"


def check_format(path: str, args) -> None:
    """Refuse, in one line, a checkpoint this loader cannot read."""
    found = detect_format(path)
    if found == "torch_dist":
        return
    flag = "--auto-detect-ckpt-format found" if args.auto_detect_ckpt_format else \
        f"--ckpt-format {args.ckpt_format}, but --load holds"
    raise UserError(f"--load {path}: {flag} a {found} checkpoint; only torch_dist loads here: convert it with "
                    f"Megatron-LM (--ckpt-convert-format torch_dist) first")


def _choose(root: str):
    """(iteration or None, notes): rank 0 reads the directory and tells every rank."""
    choice = [None]
    if torch.distributed.get_rank() == 0:
        try:
            iteration, notes = integrity.choose_checkpoint(root)
            choice = [(iteration, notes, None)]
        except ValueError as err:
            choice = [(None, [], str(err))]
    torch.distributed.broadcast_object_list(choice, src=0)
    iteration, notes, problem = choice[0]
    if problem:
        raise UserError(f"--load {root}: {problem}")
    return iteration, notes


def saved_in_offloaded_form(common: dict) -> bool:
    """Whether a checkpoint (its common state) holds the optimizer state in offload files."""
    saved_optimizer = common.get("optimizer")
    return isinstance(saved_optimizer, dict) and "offload_meta" in saved_optimizer


def _model_parallel_words(tp, pp, vpp) -> str:
    return f"TP={tp} PP={pp}" + (f" VPP={vpp}" if vpp else "")


def _check_plain_state_layout(common: dict, saved, path: str) -> None:
    """megatron-core's dp_reshardable state (Megatron-LM's default) is one flat tensor per DDP bucket
    of each model-parallel position: it reshards across DP only. Say so before dist_checkpointing's
    KeyError or shape mismatch."""
    sharding = (common.get("content_metadata") or {}).get("distrib_optim_sharding_type") or \
        (common.get("optimizer") or {}).get("param_state_sharding_type")
    if saved is None or sharding not in (None, "dp_reshardable"):
        return  # fully_reshardable and the like reshard by themselves
    then = (saved.tensor_model_parallel_size, saved.pipeline_model_parallel_size,
            getattr(saved, "virtual_pipeline_model_parallel_size", None))
    now = (parallel_state.get_tensor_model_parallel_world_size(), parallel_state.get_pipeline_model_parallel_world_size(),
           parallel_state.get_virtual_pipeline_model_parallel_world_size())
    if then != now:
        raise UserError(f"--load {path}: its optimizer state is megatron-core's dp_reshardable form, saved at "
                        f"{_model_parallel_words(*then)}; it loads only at those TP, PP and virtual pipeline sizes, "
                        f"this run is {_model_parallel_words(*now)}: resume at {_model_parallel_words(*then)}, convert "
                        f"it there with tools/convert_offload_checkpoint.py --to offload (the offloaded form "
                        f"reshards), or pass --no-load-optim to load the weights only")


def _layout_now() -> dict:
    return {"tp": parallel_state.get_tensor_model_parallel_world_size(),
            "pp": parallel_state.get_pipeline_model_parallel_world_size(),
            "dp": parallel_state.get_data_parallel_world_size()}


def _rng_plan(saved, args):
    """(whether the RNG states load; a note on why not, or None)."""
    if args.no_load_rng or args.finetune:
        return False, None
    if saved is None or getattr(saved, "no_save_rng", False):
        return False, "the checkpoint holds no RNG states: they start from --seed"
    now = _layout_now()
    then = {"tp": saved.tensor_model_parallel_size, "pp": saved.pipeline_model_parallel_size,
            "dp": getattr(saved, "data_parallel_size", None)}
    # Upstream saves one state per (pp, tp) unless --data-parallel-random-init; this repo, every DP rank's.
    per_dp = getattr(saved, "data_parallel_random_init", True)
    if then["tp"] != now["tp"] or then["pp"] != now["pp"] or (then["dp"] != now["dp"] and per_dp):
        return False, (f"checkpoint layout {then} differs from this run's {now}: resharding; RNG states start "
                       f"from --seed")
    return True, None
