"""Uneven pipeline splits, as Megatron-LM gives them: the first or the last pipeline rank builds its own number of
transformer layers (``--decoder-first-pipeline-num-layers``, ``--decoder-last-pipeline-num-layers``) and the ranks
between share the rest evenly; or the embedding and the loss each take a layer's place in an even split
(``--account-for-embedding-in-pipeline-split``, ``--account-for-loss-in-pipeline-split``). megatron-core's
TransformerConfig carries the split and builds each rank's layers from it (``layer_params.stage_layer_counts``
counts them as it does). Each flag's problem is one line here, before megatron-core's config asserts it.
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Dict, List

from megatron.training.errors import positive_int
from megatron.training.model.layer_params import stage_layer_counts

FIRST_FLAG = "--decoder-first-pipeline-num-layers"
LAST_FLAG = "--decoder-last-pipeline-num-layers"
EMBEDDING_FLAG = "--account-for-embedding-in-pipeline-split"
LOSS_FLAG = "--account-for-loss-in-pipeline-split"


def add_flags(group) -> None:
    group.add_argument(FIRST_FLAG, type=positive_int, default=None,
                       help="transformer layers of the first pipeline rank; the ranks between the first and the last "
                            "share the others evenly")
    group.add_argument(LAST_FLAG, type=positive_int, default=None,
                       help="transformer layers of the last pipeline rank; the ranks between the first and the last "
                            "share the others evenly")
    group.add_argument(EMBEDDING_FLAG, action="store_true",
                       help="the input embedding counts as a layer of the first pipeline rank in an even split")
    group.add_argument(LOSS_FLAG, action="store_true",
                       help="the output layer and loss count as a layer of the last pipeline rank in an even split")


def config_fields(args) -> Dict[str, object]:
    """The split's TransformerConfig fields."""
    return {"num_layers_in_first_pipeline_stage": args.decoder_first_pipeline_num_layers,
            "num_layers_in_last_pipeline_stage": args.decoder_last_pipeline_num_layers,
            "account_for_embedding_in_pipeline_split": args.account_for_embedding_in_pipeline_split,
            "account_for_loss_in_pipeline_split": args.account_for_loss_in_pipeline_split}


def stage_layers(args) -> List[int]:
    """Transformer layers of each pipeline rank, from the flags."""
    return stage_layer_counts(SimpleNamespace(num_layers=args.num_layers,
                                              pipeline_model_parallel_size=args.pipeline_model_parallel_size,
                                              **config_fields(args)))


def validate(parser, args) -> None:
    """Megatron-LM's checks of the split (an even one included: --num-layers over the ranks), each one line."""
    pp, layers = args.pipeline_model_parallel_size, args.num_layers
    first, last = args.decoder_first_pipeline_num_layers, args.decoder_last_pipeline_num_layers
    accounted = [f for f, on in ((EMBEDDING_FLAG, args.account_for_embedding_in_pipeline_split),
                                 (LOSS_FLAG, args.account_for_loss_in_pipeline_split)) if on]
    given = [f"{flag} {n}" for flag, n in ((FIRST_FLAG, first), (LAST_FLAG, last)) if n is not None]
    if given and accounted:
        parser.error(f"argument {accounted[0]}: not allowed with {given[0]} (give the split one way)")
    if given and pp == 1:
        parser.error(f"argument {given[0]}: needs --pipeline-model-parallel-size above 1")
    interleaved = [f for f, n in (("--num-layers-per-virtual-pipeline-stage", args.num_layers_per_virtual_pipeline_stage),
                                  ("--num-virtual-stages-per-pipeline-rank", args.num_virtual_stages_per_pipeline_rank))
                   if n is not None]
    if (given or accounted) and interleaved:
        parser.error(f"argument {(given or accounted)[0]}: not allowed with {interleaved[0]} here (the interleaved "
                     f"pipeline's chunks are even)")
    if given:
        middle_ranks = pp - len(given)
        middle_layers = layers - sum(n for n in (first, last) if n is not None)
        if middle_layers < 0 or bool(middle_layers) != bool(middle_ranks) or (
                middle_ranks and middle_layers % middle_ranks):
            parser.error(f"argument {given[-1]}: leaves {middle_layers} of --num-layers {layers} to the other "
                         f"{middle_ranks} pipeline ranks, which must share them evenly (at least one each)")
        return
    units = layers + len(accounted)
    if units % pp:
        what = f"--num-layers {layers}" + "".join(f" + 1 ({f})" for f in accounted)
        parser.error(f"argument --pipeline-model-parallel-size {pp}: must divide {what}")
    if accounted and min(stage_layers(args)) < 1:
        parser.error(f"argument {accounted[0]}: leaves a pipeline rank without a transformer layer "
                     f"(--num-layers {layers} over {pp} ranks)")
