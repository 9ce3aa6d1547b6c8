"""The MoE and model-family flags: Megatron-LM's defaults, derivations and one-line errors, and the
--moe-layer-freq pattern against Python's own evaluation of the same expression."""

import pytest
from hypothesis import given, settings, strategies as st

from megatron.training.args.arguments import parse_args
from megatron.training.args.moe import layer_pattern
from megatron.training.model.moe import tracked_losses
from megatron.training.errors import UserError
from megatron.training.model.configs import transformer_config

BASE = ["--num-layers", "4", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "32",
        "--micro-batch-size", "1", "--train-iters", "10", "--lr", "1e-3", "--mock-data", "--device", "cpu"]


def one_line_error(argv) -> str:
    with pytest.raises(UserError) as exc:
        parse_args(argv)
    assert "\n" not in str(exc.value)
    return str(exc.value)


def test_megatron_lm_defaults_and_derivations():
    args = parse_args(BASE + ["--num-experts", "8", "--ffn-hidden-size", "96"])
    assert (args.moe_router_topk, args.moe_aux_loss_coeff, args.moe_router_load_balancing_type) == (2, 0.0, "aux_loss")
    assert args.moe_token_dispatcher_type == "allgather" and args.moe_layer_freq == 1 and args.moe_router_dtype is None
    assert args.moe_ffn_hidden_size == 96 and args.expert_model_parallel_size == 1
    assert args.expert_tensor_parallel_size == args.tensor_model_parallel_size == 1
    assert tracked_losses(args) == ["load_balancing_loss"]
    assert parse_args(BASE + ["--num-experts", "0"]).num_experts is None  # 0 means dense, as upstream
    config = transformer_config(parse_args(BASE + ["--num-experts", "4", "--moe-grouped-gemm", "--qk-layernorm",
                                                   "--moe-router-dtype", "fp32", "--moe-z-loss-coeff", "1e-3"]))
    assert config.num_moe_experts == 4 and config.qk_layernorm and config.moe_router_dtype == "fp32"
    assert not config.moe_grouped_gemm  # no kernel on a CPU run: megatron-core's sequential experts


def test_family_flags():
    llama = parse_args(BASE + ["--use-rotary-position-embeddings", "--no-position-embedding", "--use-rope-scaling",
                               "--no-mmap-bin-files", "--no-create-attention-mask-in-dataloader"])
    assert llama.position_embedding_type == "rope" and llama.use_rope_scaling and llama.rope_scaling_factor == 8.0
    assert not llama.mmap_bin_files and not llama.create_attention_mask_in_dataloader
    assert "--position-embedding-type rope" in one_line_error(BASE + ["--no-position-embedding"])
    assert "--step-batch-size-schedule" in one_line_error(BASE + ["--step-batch-size-schedule", "0:16 2.4B:320"])


@pytest.mark.parametrize("extra,flag,words", [
    (["--num-experts", "6", "--expert-model-parallel-size", "4"], "--expert-model-parallel-size", "4 must divide"),
    (["--num-experts", "4", "--moe-router-topk", "5"], "--moe-router-topk", "5 exceeds --num-experts 4"),
    (["--num-experts", "4", "--moe-router-topk", "1"], "--moe-router-topk 1", "--moe-router-pre-softmax"),
    (["--expert-model-parallel-size", "2"], "--expert-model-parallel-size", "requires --num-experts"),
    (["--moe-grouped-gemm"], "--moe-grouped-gemm", "requires --num-experts"),
    (["--num-experts", "4", "--moe-layer-freq", "[1,0]"], "--moe-layer-freq", "2 entries, --num-layers is 4"),
    (["--num-experts", "4", "--moe-layer-freq", "__import__('os')"], "--moe-layer-freq", "pattern"),
    (["--num-experts", "4", "--moe-token-dispatcher-type", "flex"], "flex", "DeepEP"),
    (["--num-experts", "4", "--moe-router-load-balancing-type", "aux_loss", "z_loss"], "--moe-router-load-balancing-type",
     "invalid choice"),
    (["--num-experts", "4", "--moe-router-load-balancing-type", "aux_loss", "seq_aux_loss"], "--moe-aux-loss-coeff",
     "one per type"),
    (["--num-experts", "4", "--tensor-model-parallel-size", "2"], "--tensor-model-parallel-size 2", "--sequence-parallel"),
])
def test_bad_moe_flags_fail_in_one_line(extra, flag, words):
    message = one_line_error(BASE + extra)
    assert flag in message and words in message, message


patterns = st.recursive(
    st.lists(st.sampled_from([0, 1]), min_size=1, max_size=4).map(str),
    lambda inner: st.one_of(st.tuples(inner, inner).map(lambda t: f"{t[0]}+{t[1]}"),
                            st.tuples(inner, st.integers(1, 4)).map(lambda t: f"({t[0]})*{t[1]}")),
    max_leaves=6)


@settings(max_examples=100, deadline=None, derandomize=True)
@given(patterns)
def test_layer_pattern_is_the_expression_upstream_evaluates(text):
    assert layer_pattern(text) == eval(text)  # the reference: Python's evaluation, as Megatron-LM's
