"""The planner's parameter count per pipeline stage equals megatron-core's GPTModel built from the
same flags, over random shapes (GQA, SwiGLU, norms, biases, tied or untied, positions, stages, MoE,
multi-latent attention)."""

from unittest import mock

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.profiles import examples
from tests.unit.helpers import megatron_world_of_one

from megatron.training.args.arguments import parse_args
from megatron.training.model.sizes import model_params, stage_params
from megatron.training.model.configs import transformer_config

from . import helpers


@pytest.fixture(scope="module", autouse=True)
def one_process_world():
    yield from megatron_world_of_one()


@st.composite
def shapes(draw):
    heads = draw(st.sampled_from([1, 2, 4]))
    groups = draw(st.sampled_from([g for g in (1, 2, 4) if heads % g == 0]))
    hidden = heads * draw(st.sampled_from([8, 16]))
    layers = draw(st.integers(1, 3))
    pp = draw(st.sampled_from([p for p in (1, 2, 3) if layers % p == 0]))
    flags = ["--num-layers", str(layers), "--hidden-size", str(hidden), "--num-attention-heads", str(heads),
             "--seq-length", "16", "--micro-batch-size", "1", "--train-iters", "1", "--lr", "1e-4",
             "--mock-data", "--vocab-size", str(draw(st.sampled_from([128, 256, 384])))]
    if groups != heads:
        flags += ["--group-query-attention", "--num-query-groups", str(groups)]
    swiglu = draw(st.booleans())
    if swiglu:
        flags += ["--swiglu"]
    # Megatron-LM's default SwiGLU width rounds 8h/3 down to a multiple of 64: zero below h = 24.
    if draw(st.booleans()) or (swiglu and hidden < 24):
        flags += ["--ffn-hidden-size", str(draw(st.integers(8, 80)))]
    flags += ["--normalization", draw(st.sampled_from(["LayerNorm", "RMSNorm"]))]
    if draw(st.booleans()):
        flags += ["--disable-bias-linear"]
    if draw(st.booleans()):
        flags += ["--untie-embeddings-and-output-weights"]
    flags += ["--position-embedding-type", draw(st.sampled_from(["learned_absolute", "rope"]))]
    return flags, pp


@settings(max_examples=examples(25), deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(shapes())
def test_stage_counts_match_megatron_core(shape):
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    flags, pp = shape
    args = parse_args(flags)
    args.padded_vocab_size = args.vocab_size
    planned = stage_params(_with_pp(transformer_config(args), pp), args.vocab_size, args.max_position_embeddings,
                           args.position_embedding_type, not args.untie_embeddings_and_output_weights)
    built = []
    for stage in range(pp):
        # One process builds each stage in turn: the stage's layers, first/last by flag.
        cfg = transformer_config(args)
        cfg.num_layers = args.num_layers // pp
        cfg.use_cpu_initialization = True  # no GPU here; the count does not depend on it
        model = GPTModel(cfg, get_gpt_layer_local_spec(normalization=args.normalization), args.vocab_size,
                         args.max_position_embeddings, pre_process=stage == 0, post_process=stage == pp - 1,
                         share_embeddings_and_output_weights=not args.untie_embeddings_and_output_weights,
                         position_embedding_type=args.position_embedding_type)
        built.append(sum(p.numel() for p in model.parameters()))
    assert [s.params for s in planned] == built, flags
    assert model_params(planned, 1) == sum(built)


def _with_pp(cfg, pp):
    cfg.pipeline_model_parallel_size = pp
    return cfg


@st.composite
def moe_shapes(draw):
    """Random MoE models: experts, top-k, expert and shared widths, layer patterns, GQA, vocabulary,
    tied or untied embeddings, pipeline stages with or without interleaved chunks."""
    flags, _ = draw(shapes())
    layers = draw(st.integers(1, 4))
    pp = draw(st.sampled_from([p for p in (1, 2) if layers % p == 0]))
    flags = _set(flags, "--num-layers", str(layers))
    experts = draw(st.sampled_from([1, 2, 3, 4, 8]))
    topk = draw(st.integers(1, experts))
    flags += ["--num-experts", str(experts), "--moe-router-topk", str(topk),
              "--moe-ffn-hidden-size", str(draw(st.integers(4, 40)))]
    if topk == 1:
        flags += ["--moe-router-pre-softmax"]  # megatron-core's rule for top-1 softmax routing
    if draw(st.booleans()):
        flags += ["--moe-layer-freq", str(draw(st.integers(1, 3)))]
    else:
        flags += ["--moe-layer-freq", str(draw(st.lists(st.sampled_from([0, 1]), min_size=layers, max_size=layers)))]
    if "--disable-bias-linear" in flags and draw(st.booleans()):  # megatron-core: no biases in shared experts
        flags += ["--moe-shared-expert-intermediate-size", str(draw(st.integers(4, 40)))]
    if draw(st.booleans()):
        flags += ["--qk-layernorm"]
    vp = 2 if pp > 1 and layers % (2 * pp) == 0 and draw(st.booleans()) else None
    if vp:
        flags += ["--num-layers-per-virtual-pipeline-stage", str(layers // (pp * vp))]
    return flags, pp


def _set(flags, name, value):
    flags = list(flags)
    flags[flags.index(name) + 1] = value
    return flags


@settings(max_examples=examples(30), deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(moe_shapes())
def test_moe_counts_match_megatron_core(shape):
    """Per stage, the dense parameters and the routed experts (``mlp.experts``; with EP > 1
    megatron-core's expert optimizer takes them) apart; the active count against the experts each
    built layer holds."""
    _assert_counts_match_built_model(*shape)


@st.composite
def mla_shapes(draw):
    """Random multi-latent attention models (DeepSeek-V2/V3's form): with or without the queries'
    low rank, latent norms, widths of each part, dense or MoE with shared experts, pipeline stages."""
    flags, pp = draw(st.one_of(moe_shapes(), shapes()))
    flags = [f for f in flags if f != "--group-query-attention"]  # Megatron-LM: not with MLA
    if "--num-query-groups" in flags:
        del flags[flags.index("--num-query-groups"):flags.index("--num-query-groups") + 2]
    flags += ["--multi-latent-attention", "--kv-lora-rank", str(draw(st.integers(2, 24))),
              "--qk-head-dim", str(draw(st.sampled_from([4, 8, 12]))),
              "--qk-pos-emb-head-dim", str(draw(st.sampled_from([2, 4, 8]))),
              "--v-head-dim", str(draw(st.sampled_from([4, 8, 16]))),
              "--rope-type", draw(st.sampled_from(["rope", "yarn"]))]
    if draw(st.booleans()):
        flags += ["--q-lora-rank", str(draw(st.integers(2, 24)))]
    if "--qk-layernorm" not in flags and draw(st.booleans()):
        flags += ["--qk-layernorm"]
    return flags, pp


@settings(max_examples=examples(20, floor=6), deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(mla_shapes())
def test_mla_counts_match_megatron_core(shape):
    """MLA's projections, latent norms and output, dense and MoE layers, per stage."""
    _assert_counts_match_built_model(*shape)


def _assert_counts_match_built_model(flags, pp):
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec
    from megatron.training.model.mla_attention import local_mla_spec
    from megatron.training.model.sizes import active_params

    args = parse_args(flags + ["--pipeline-model-parallel-size", str(pp)])
    args.padded_vocab_size = args.vocab_size
    cfg = transformer_config(args)
    planned = stage_params(cfg, args.vocab_size, args.max_position_embeddings, args.position_embedding_type,
                           not args.untie_embeddings_and_output_weights)
    chunks = args.virtual_pipeline_model_parallel_size or 1
    built, skipped = [], 0
    for stage in range(pp):
        dense = experts = 0
        for chunk in range(chunks):
            # One process builds each stage's chunks in turn: the layers megatron-core's spec gives
            # them, in a model of one stage (first/last by flag), as the dense test above does.
            spec = get_gpt_decoder_block_spec(cfg, use_transformer_engine=False, normalization=args.normalization,
                                              vp_stage=chunk if chunks > 1 else None, pp_rank=stage)
            if args.multi_latent_attention:
                spec = local_mla_spec(spec)  # as pretrain_gpt.py builds it
            build_cfg = transformer_config(args)
            build_cfg.use_cpu_initialization = True
            build_cfg.num_layers = len(spec.layer_specs)
            build_cfg.pipeline_model_parallel_size, build_cfg.virtual_pipeline_model_parallel_size = 1, None
            # MLA builds its RoPE on torch.cuda.current_device() whatever use_cpu_initialization says
            # (a training run's cpu_compat answers it): the CPU here too.
            with mock.patch("torch.cuda.current_device", return_value=torch.device("cpu")):
                model = GPTModel(build_cfg, spec, args.vocab_size, args.max_position_embeddings,
                                 pre_process=stage == 0 and chunk == 0,
                                 post_process=stage == pp - 1 and chunk == chunks - 1,
                                 share_embeddings_and_output_weights=not args.untie_embeddings_and_output_weights,
                                 position_embedding_type=args.position_embedding_type)
            params = dict(model.named_parameters())
            dense += sum(p.numel() for name, p in params.items() if ".mlp.experts." not in name)
            experts += sum(p.numel() for name, p in params.items() if ".mlp.experts." in name)
            for layer in model.decoder.layers:
                routed = getattr(layer.mlp, "experts", None)
                if routed is not None and args.num_experts:  # the experts a token skips: all but top-k
                    one = sum(p.numel() for p in routed.local_experts[0].parameters())
                    skipped += (args.num_experts - args.moe_router_topk) * one
        built.append((dense, experts))
    assert [(s.dense, s.experts) for s in planned] == built, flags
    total = model_params(planned, 1, 1)
    assert total == sum(d + e for d, e in built)
    assert active_params(cfg, total) == total - skipped, flags
