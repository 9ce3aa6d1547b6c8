"""Megatron-LM's learning-rate and weight-decay schedule, counted in samples.

Iteration-based runs (--train-iters) give warmup/decay in iterations, converted with the global
batch size; sample-based runs (--train-samples) give them in samples. ``--lr-warmup-fraction`` is a
fraction of the decay length in either. The result feeds megatron-core's OptimizerParamScheduler.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional


@dataclass(frozen=True)
class ScheduleSteps:
    warmup: float
    decay: int
    wd_incr: int
    wsd_decay: Optional[int]


def schedule_steps(args, global_batch_size: int) -> ScheduleSteps:
    """Lengths in samples, as Megatron-LM's get_optimizer_param_scheduler computes them."""
    if args.train_samples is None:
        decay = args.lr_decay_iters * global_batch_size
        wd_incr = args.train_iters * global_batch_size
        wsd = None if args.lr_wsd_decay_iters is None else args.lr_wsd_decay_iters * global_batch_size
        warmup_by_count = args.lr_warmup_iters * global_batch_size
    else:
        decay = args.lr_decay_samples
        wd_incr = args.train_samples
        wsd = args.lr_wsd_decay_samples
        warmup_by_count = args.lr_warmup_samples
    warmup = args.lr_warmup_fraction * decay if args.lr_warmup_fraction is not None else warmup_by_count
    return ScheduleSteps(warmup=warmup, decay=decay, wd_incr=wd_incr, wsd_decay=wsd)


def build_param_scheduler(args, optimizer, global_batch_size: int):
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

    steps = schedule_steps(args, global_batch_size)
    return OptimizerParamScheduler(
        optimizer,
        init_lr=args.lr_warmup_init,
        max_lr=args.lr,
        min_lr=args.min_lr,
        lr_warmup_steps=steps.warmup,
        lr_decay_steps=steps.decay,
        lr_decay_style=args.lr_decay_style,
        start_wd=args.start_weight_decay,
        end_wd=args.end_weight_decay,
        wd_incr_steps=steps.wd_incr,
        wd_incr_style=args.weight_decay_incr_style,
        wsd_decay_steps=steps.wsd_decay,
        lr_wsd_decay_style=args.lr_wsd_decay_style,
    )


def validate(args, error) -> None:
    """Megatron-LM's rules for which warmup/decay flags go with iteration- or sample-based training,
    checked before megatron-core would assert on them."""
    by_samples = args.train_samples is not None
    wrong_unit = ([("--lr-decay-iters", args.lr_decay_iters is not None), ("--lr-warmup-iters", args.lr_warmup_iters),
                   ("--lr-wsd-decay-iters", args.lr_wsd_decay_iters is not None)] if by_samples else
                  [("--lr-decay-samples", args.lr_decay_samples is not None),
                   ("--lr-warmup-samples", args.lr_warmup_samples),
                   ("--lr-wsd-decay-samples", args.lr_wsd_decay_samples is not None)])
    for flag, given in wrong_unit:
        if given:
            error(f"argument {flag}: not allowed with {'--train-samples' if by_samples else '--train-iters'} "
                  f"(use the {'samples' if by_samples else 'iters'} form)")
    if args.lr_warmup_fraction is not None:
        other = "--lr-warmup-samples" if by_samples else "--lr-warmup-iters"
        if args.lr_warmup_samples or args.lr_warmup_iters:
            error(f"argument --lr-warmup-fraction: not allowed with {other}")
        if args.lr_warmup_fraction >= 1.0:
            error(f"argument --lr-warmup-fraction: must be below 1 (warmup shorter than decay), "
                  f"got {args.lr_warmup_fraction}")
    if by_samples:
        if args.lr_decay_samples is None:
            args.lr_decay_samples = args.train_samples
    elif args.lr_decay_iters is None:
        args.lr_decay_iters = args.train_iters
    # In one unit (iterations or samples) the global batch size cancels out.
    steps = schedule_steps(args, 1)
    if steps.warmup >= steps.decay:
        unit = "samples" if by_samples else "iters"
        error(f"argument --lr-warmup-{unit}: {args.lr_warmup_samples if by_samples else args.lr_warmup_iters} "
              f"must be below --lr-decay-{unit} (default --train-{unit}), which is {steps.decay}")
    if args.lr_decay_style == "WSD" and steps.wsd_decay is None:
        error(f"argument --lr-decay-style WSD: needs --lr-wsd-decay-{'samples' if by_samples else 'iters'}")
    if args.lr_warmup_init > args.lr:
        error(f"argument --lr-warmup-init: {args.lr_warmup_init} must be <= --lr {args.lr}")
    if args.weight_decay_incr_style == "constant":
        for flag, value in (("--start-weight-decay", args.start_weight_decay),
                            ("--end-weight-decay", args.end_weight_decay)):
            if value is not None and value != args.weight_decay:
                error(f"argument {flag}: needs --weight-decay-incr-style linear or cosine "
                      "(constant uses --weight-decay)")
        args.start_weight_decay = args.end_weight_decay = args.weight_decay
    else:
        if args.start_weight_decay is None or args.end_weight_decay is None:
            error(f"argument --weight-decay-incr-style {args.weight_decay_incr_style}: needs "
                  "--start-weight-decay and --end-weight-decay")
        if args.end_weight_decay < args.start_weight_decay:
            error("argument --end-weight-decay: must be >= --start-weight-decay")
