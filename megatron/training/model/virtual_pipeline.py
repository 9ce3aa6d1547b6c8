"""The interleaved (virtual) pipeline, as Megatron-LM runs it: V model chunks per pipeline rank.

``--num-layers-per-virtual-pipeline-stage N`` or ``--num-virtual-stages-per-pipeline-rank V`` give
``args.virtual_pipeline_model_parallel_size`` (None where it comes to 1, as upstream). Rank r's
chunk v holds global layers from ``(v * PP + r) * layers_per_chunk`` (megatron-core's
get_transformer_layer_offset); only chunk 0 of the first rank embeds and only the last chunk of
the last rank computes the loss. megatron-core's interleaved schedule gives each chunk its own data
iterator and runs the micro-batches in groups of ``--microbatch-group-size-per-virtual-pipeline-stage``
(default PP), which constrains the number of micro-batches per step (``microbatch_problem``).
"""

from __future__ import annotations

import itertools
from typing import Iterator, List, Optional, Tuple

from megatron.training.errors import UserError
from megatron.training.errors import positive_int

LAYERS_FLAG = "--num-layers-per-virtual-pipeline-stage"
STAGES_FLAG = "--num-virtual-stages-per-pipeline-rank"
GROUP_FLAG = "--microbatch-group-size-per-virtual-pipeline-stage"


def add_flags(group) -> None:
    group.add_argument(LAYERS_FLAG, type=positive_int, default=None,
                       help="interleaved pipeline: transformer layers per model chunk (V = layers per stage / N)")
    group.add_argument(STAGES_FLAG, type=positive_int, default=None,
                       help="interleaved pipeline: model chunks (virtual stages) per pipeline rank")
    group.add_argument("--no-overlap-p2p-communication", dest="overlap_p2p_comm", action="store_false",
                       help="interleaved pipeline: batched, not overlapped, sends and receives (needs PP > 2)")
    group.add_argument(GROUP_FLAG, dest="microbatch_group_size_per_vp_stage", type=positive_int, default=None,
                       help="interleaved pipeline: micro-batches each chunk runs back to back (default PP)")


def validate(parser, args) -> None:
    """Derive args.virtual_pipeline_model_parallel_size with Megatron-LM's checks, each one line.
    Runs after --num-layers was checked to be a multiple of --pipeline-model-parallel-size."""
    layers, stages = args.num_layers_per_virtual_pipeline_stage, args.num_virtual_stages_per_pipeline_rank
    pp = args.pipeline_model_parallel_size
    per_stage = args.num_layers // pp
    size = None
    if layers is not None and stages is not None:
        parser.error(f"argument {STAGES_FLAG}: not allowed with {LAYERS_FLAG} (give one of them)")
    if layers is not None:
        if per_stage % layers:
            parser.error(f"argument {LAYERS_FLAG} {layers}: must divide the layers per pipeline stage "
                         f"(--num-layers {args.num_layers} / --pipeline-model-parallel-size {pp} = {per_stage})")
        size = per_stage // layers
    elif stages is not None:
        # megatron-core's TransformerConfig asserts this; said here as one line naming the flag
        if per_stage % stages:
            parser.error(f"argument {STAGES_FLAG} {stages}: must divide the layers per pipeline stage "
                         f"(--num-layers {args.num_layers} / --pipeline-model-parallel-size {pp} = {per_stage})")
        size = stages
    args.virtual_pipeline_model_parallel_size = size if size != 1 else None
    if args.virtual_pipeline_model_parallel_size is None:
        args.overlap_p2p_comm = False  # only the interleaved schedule overlaps its sends and receives
        return
    flag = LAYERS_FLAG if layers is not None else STAGES_FLAG
    given = f"{flag} {layers if layers is not None else stages}"
    if args.overlap_p2p_comm and pp < 2:
        parser.error(f"argument {given}: the interleaved schedule needs --pipeline-model-parallel-size above 1, "
                     f"got {pp}")
    if not args.overlap_p2p_comm and pp < 3:
        # Two ranks would exchange several batched sends and receives with each other at once.
        parser.error(f"argument {given}: with --no-overlap-p2p-communication the interleaved schedule needs "
                     f"--pipeline-model-parallel-size above 2, got {pp}")
    group = args.microbatch_group_size_per_vp_stage
    if group is not None and group < pp:
        parser.error(f"argument {GROUP_FLAG} {group}: must be at least --pipeline-model-parallel-size {pp}")


def microbatch_problem(num_microbatches: int, pp: int, group: Optional[int]) -> Optional[str]:
    """Why megatron-core's interleaved schedule would refuse ``num_microbatches`` per step, or None."""
    group = group or pp
    if num_microbatches < group:
        named = (f"--pipeline-model-parallel-size {pp}" if group == pp else
                 f"{GROUP_FLAG} {group} (the micro-batches each model chunk runs back to back)")
        return f"{num_microbatches} micro-batches per step are fewer than {named}"
    last = num_microbatches % group
    if 0 < last < pp:
        if group == pp:
            return f"{num_microbatches} micro-batches per step are not a multiple of --pipeline-model-parallel-size {pp}"
        return (f"{num_microbatches} micro-batches per step leave a last group of {last} ({GROUP_FLAG} {group}), "
                f"fewer than --pipeline-model-parallel-size {pp}")
    return None


def check_microbatches(args, global_batch_sizes) -> None:
    """Every global batch size of the run (one, or each of a ramp-up) must come to a number of
    micro-batches the interleaved schedule takes; a UserError naming the numbers otherwise."""
    if args.virtual_pipeline_model_parallel_size is None:
        return
    for size in global_batch_sizes:
        problem = microbatch_problem(size // (args.micro_batch_size * args.data_parallel_size),
                                     args.pipeline_model_parallel_size, args.microbatch_group_size_per_vp_stage)
        if problem:
            raise UserError(f"--global-batch-size {size}: {problem}, which the interleaved pipeline schedule cannot "
                            f"run (a micro-batch: --micro-batch-size {args.micro_batch_size} on each of "
                            f"{args.data_parallel_size} data-parallel ranks)")


def chunk_roles(pp_rank: int, pp_size: int, vp_size: Optional[int]) -> List[Tuple[Optional[int], bool, bool]]:
    """(vp_stage, pre_process, post_process) of each model chunk this pipeline rank builds."""
    if vp_size is None:
        return [(None, pp_rank == 0, pp_rank == pp_size - 1)]
    return [(v, pp_rank == 0 and v == 0, pp_rank == pp_size - 1 and v == vp_size - 1) for v in range(vp_size)]


def per_chunk(iterator: Iterator, chunks: int):
    """The data iterator for megatron-core's schedule: one per chunk, each yielding the same
    micro-batches (every chunk runs every micro-batch); a single chunk gets the iterator itself."""
    if chunks == 1:
        return iterator
    return list(itertools.tee(iterator, chunks))
