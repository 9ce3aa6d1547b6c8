"""Megatron-LM's uneven pipeline split flags (model.uneven_pipeline): a split the parser takes is one megatron-core's
TransformerConfig takes and builds as the flags say (its own get_num_layers_to_build, rank by rank), one it refuses is
refused in one line naming a flag before any config is made; the planner's activations follow the split."""

import pytest
import torch
from hypothesis import given, settings, strategies as st
from megatron.core.transformer import TransformerConfig
from megatron.core.transformer.transformer_block import get_num_layers_to_build

from megatron.training.args.arguments import parse_args
from megatron.training.errors import UserError
from megatron.training.model.configs import transformer_config
from megatron.training.model.sizes import kept_input_bytes
from megatron.training.model.uneven_pipeline import config_fields, stage_layers
from megatron.training.offload.activation_memory import activation_bytes

BASE = ["--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "32", "--micro-batch-size", "1",
        "--train-iters", "10", "--lr", "1e-3", "--mock-data", "--device", "cpu"]


def split_argv(layers, pp, first, last, embedding, loss):
    argv = BASE + ["--num-layers", str(layers), "--pipeline-model-parallel-size", str(pp)]
    argv += ["--decoder-first-pipeline-num-layers", str(first)] if first is not None else []
    argv += ["--decoder-last-pipeline-num-layers", str(last)] if last is not None else []
    argv += ["--account-for-embedding-in-pipeline-split"] if embedding else []
    argv += ["--account-for-loss-in-pipeline-split"] if loss else []
    return argv


def megatron_core_counts(layers, pp, first, last, embedding, loss):
    """Each rank's layers as megatron-core builds them, or None where its config refuses the split."""
    try:
        config = TransformerConfig(num_layers=layers, hidden_size=64, num_attention_heads=4,
                                   pipeline_model_parallel_size=pp, pipeline_dtype=torch.float32,
                                   num_layers_in_first_pipeline_stage=first, num_layers_in_last_pipeline_stage=last,
                                   account_for_embedding_in_pipeline_split=embedding,
                                   account_for_loss_in_pipeline_split=loss)
        counts = [get_num_layers_to_build(config, pp_rank=rank) for rank in range(pp)]
    except (ValueError, AssertionError):
        return None
    return counts if min(counts) >= 1 else None  # a rank without a layer: the parser refuses it


@settings(max_examples=150, deadline=None)
@given(layers=st.integers(1, 24), pp=st.integers(1, 6), first=st.none() | st.integers(1, 12),
       last=st.none() | st.integers(1, 12), embedding=st.booleans(), loss=st.booleans())
def test_the_parser_takes_the_splits_megatron_core_builds(layers, pp, first, last, embedding, loss):
    expected = megatron_core_counts(layers, pp, first, last, embedding, loss)
    if (first is not None or last is not None) and (embedding or loss or pp == 1):
        expected = None  # Megatron-LM takes the split one way only, and an uneven one over several ranks
    argv = split_argv(layers, pp, first, last, embedding, loss)
    if expected is None:
        with pytest.raises(UserError) as refused:
            parse_args(argv)
        assert "\n" not in str(refused.value) and str(refused.value).startswith("argument --")
        return
    args = parse_args(argv)
    assert stage_layers(args) == expected
    config = transformer_config(args)
    assert {k: getattr(config, k) for k in config_fields(args)} == config_fields(args)
    assert [get_num_layers_to_build(config, pp_rank=rank) for rank in range(pp)] == expected


def test_refusals_name_the_flag_and_the_numbers():
    def error(argv):
        with pytest.raises(UserError) as refused:
            parse_args(argv)
        return str(refused.value)

    assert "--decoder-first-pipeline-num-layers 1: leaves 7 of --num-layers 8 to the other 2 pipeline ranks" in error(
        split_argv(8, 3, 1, None, False, False))
    assert "--account-for-loss-in-pipeline-split: not allowed with --decoder-last-pipeline-num-layers 2" in error(
        split_argv(6, 3, None, 2, False, True))
    assert "must divide --num-layers 4 + 1 (--account-for-embedding-in-pipeline-split)" in error(
        split_argv(4, 2, None, None, True, False))
    assert "needs --pipeline-model-parallel-size above 1" in error(split_argv(4, 1, 4, None, False, False))
    assert "not allowed with --num-virtual-stages-per-pipeline-rank" in error(
        split_argv(8, 2, 2, None, False, False) + ["--num-virtual-stages-per-pipeline-rank", "2"])


def test_the_planners_activations_follow_the_stage_with_the_most_layers_in_flight():
    """1F1B over 4 ranks, 4 micro-batches in flight on the first: evenly 4 layers x 4 bind; with the first rank's
    1 layer, the second's 5 layers x 3 micro-batches do (15 layer inputs kept, one fewer)."""
    recompute = ["--recompute-granularity", "full", "--recompute-method", "uniform"]
    even = parse_args(split_argv(16, 4, None, None, False, False) + recompute)
    light_first = parse_args(split_argv(16, 4, 1, None, False, False) + recompute)
    assert stage_layers(light_first) == [1, 5, 5, 5]
    kept = kept_input_bytes(even.seq_length, even.micro_batch_size, transformer_config(even))
    difference = (activation_bytes(light_first, transformer_config(light_first), 4)
                  - activation_bytes(even, transformer_config(even), 4))
    assert difference == pytest.approx((15 - 16) * kept, abs=2)
