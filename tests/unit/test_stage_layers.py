"""Pipeline stages of unequal layers, as megatron-core's TransformerConfig makes them (its first and last stages'
own counts, or the embedding and the loss each taking a layer's place): which layers each stage builds
(``model.layer_params``) and the layer-major step's kept inputs the planner counts, those of the stage with the most
layers (every stage holds all its micro-batches' inputs at once). The layer-major step itself runs such splits as
megatron-core's 1F1B does (tests/integration/test_uneven_pipeline_cpu.py)."""

from types import SimpleNamespace

import torch
from hypothesis import given, settings, strategies as st
from megatron.core.transformer import TransformerConfig
from megatron.core.transformer.transformer_block import get_num_layers_to_build
from megatron.core.transformer.transformer_layer import get_transformer_layer_offset

from megatron.training.model.layer_params import layers_of_stage, stage_layer_counts
from megatron.training.offload.activation_memory import layer_major_activation_bytes
from tests.profiles import examples


@st.composite
def splits(draw):
    """(each stage's layers, written out; the config's fields that give them)."""
    pp = draw(st.integers(1, 6))
    if pp > 1 and draw(st.booleans()):  # the first and/or the last stage's own count, the rest even between
        first, last = draw(st.sampled_from([(True, False), (False, True), (True, True)]))
        stages = [draw(st.integers(1, 8))] * pp
        fields = {}
        if first:
            stages[0] = fields["num_layers_in_first_pipeline_stage"] = draw(st.integers(1, 12))
        if last:
            stages[-1] = fields["num_layers_in_last_pipeline_stage"] = draw(st.integers(1, 12))
    else:  # an even split of the layers with the embedding and/or the loss counted as one
        embedding, loss = draw(st.booleans()), draw(st.booleans())
        stages = [draw(st.integers(3, 8))] * pp
        stages[0] -= embedding
        stages[-1] -= loss
        fields = {"account_for_embedding_in_pipeline_split": embedding, "account_for_loss_in_pipeline_split": loss}
    config = TransformerConfig(num_layers=sum(stages), hidden_size=64, num_attention_heads=4,
                               pipeline_model_parallel_size=pp, pipeline_dtype=torch.float32, **fields)
    return stages, config


@settings(max_examples=examples(100), deadline=None)
@given(split=splits(), microbatches=st.integers(1, 16))
def test_the_planner_counts_the_kept_inputs_of_the_stage_with_the_most_layers(split, microbatches):
    stages, config = split
    assert stage_layer_counts(config) == stages
    # The same split megatron-core builds: each stage's count and its first layer's number.
    assert [get_num_layers_to_build(config, pp_rank=r) for r in range(len(stages))] == stages
    runs = [layers_of_stage(config, r) for r in range(len(stages))]
    assert sum(runs, []) == list(range(config.num_layers)) and [len(run) for run in runs] == stages
    assert [run[0] for run in runs] == [get_transformer_layer_offset(config, pp_rank=r) for r in range(len(stages))]
    args = SimpleNamespace(seq_length=128, micro_batch_size=2, padded_vocab_size=1024, device="cpu")
    kept = 2 * 128 * 2 * 64  # one layer's input for one micro-batch: 16-bit, sequence x micro-batch x hidden
    _, host = layer_major_activation_bytes(args, config, microbatches, inputs_in_host=True)
    assert host == max(stages) * microbatches * kept
