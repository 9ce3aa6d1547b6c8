"""Global batch size per iteration (constant, or ramped up with --rampup-batch-size) and the
number of iterations a --train-samples run takes, through megatron-core's microbatch calculator."""

from __future__ import annotations

from megatron.core import num_microbatches_calculator as calculator

from megatron.training.model import virtual_pipeline
from megatron.training.errors import UserError


def init(args) -> None:
    """After the data-parallel size is known: set up megatron-core's calculator, args.num_microbatches
    and, for a sample-based run, args.train_iters."""
    per_step = args.micro_batch_size * args.data_parallel_size
    if args.rampup_batch_size is not None:
        start, increment, _samples = args.rampup_batch_size
        if start >= args.global_batch_size:
            raise UserError(f"--rampup-batch-size: the start batch size {start} must be below "
                            f"--global-batch-size {args.global_batch_size}")
        for name, value in (("start batch size", start), ("batch size increment", increment)):
            if value % per_step:
                raise UserError(f"--rampup-batch-size: {name} {value} is not a multiple of "
                                f"micro-batch-size x data-parallel-size = {per_step}")
        if (args.global_batch_size - start) % increment:
            raise UserError(f"--rampup-batch-size: --global-batch-size {args.global_batch_size} minus the start "
                            f"{start} is not a multiple of the increment {increment}")
    virtual_pipeline.check_microbatches(args, _distinct_batch_sizes(args))
    calculator.destroy_num_microbatches_calculator()
    calculator.init_num_microbatches_calculator(
        args.rank, args.rampup_batch_size, args.global_batch_size, args.micro_batch_size, args.data_parallel_size)
    args.num_microbatches = calculator.get_num_microbatches()
    if args.train_samples is not None:
        args.train_iters = iterations_for_samples(args)
    # The training set's size, as Megatron-LM asks its dataset builder for (it decides the epochs and shuffle).
    args.train_samples_total = args.train_samples or args.train_iters * args.global_batch_size


def advance(args, consumed_samples: int) -> int:
    """Before an iteration: its global batch size (also args.current_global_batch_size;
    args.num_microbatches follows it)."""
    calculator.update_num_microbatches(consumed_samples, consistency_check=True)
    args.num_microbatches = calculator.get_num_microbatches()
    args.current_global_batch_size = calculator.get_current_global_batch_size()
    return args.current_global_batch_size


def _distinct_batch_sizes(args):
    """Every global batch size the run will use: the ramp's steps, then --global-batch-size."""
    if args.rampup_batch_size is None:
        return [args.global_batch_size]
    start, increment, _samples = args.rampup_batch_size
    return [*range(start, args.global_batch_size, increment), args.global_batch_size]


def _batch_sizes(args):
    """The global batch size of each iteration from the start, without touching the calculator."""
    consumed = 0
    while True:
        if args.rampup_batch_size is None:
            size = args.global_batch_size
        else:
            start, increment, samples = args.rampup_batch_size
            if consumed > samples:
                size = args.global_batch_size
            else:  # the calculator's arithmetic (RampupBatchsizeNumMicroBatchesCalculator.update)
                per_increment = samples / ((args.global_batch_size - start) // increment)
                size = min(args.global_batch_size, start + int(consumed / per_increment) * increment)
        yield size
        consumed += size


def iterations_for_samples(args) -> int:
    """As Megatron-LM's update_train_iters: whole batches only, the last partial one dropped."""
    if args.rampup_batch_size is None:
        return args.train_samples // args.global_batch_size
    _start, _increment, rampup_samples = args.rampup_batch_size
    sizes = _batch_sizes(args)
    iterations, consumed = 0, 0
    while consumed <= rampup_samples and consumed <= args.train_samples:
        consumed += next(sizes)
        iterations += 1
    if args.train_samples > consumed:
        iterations += (args.train_samples - consumed) // args.global_batch_size
    return iterations
