"""An auto gpu tier starts at half of what the activation estimate leaves free after the model, so the
first iteration no longer streams from disk what HBM could hold; never above what the run later learnt."""

import pytest

from megatron.training.args.arguments import parse_args
from megatron.training.errors import UserError
from megatron.training.model.configs import transformer_config
from megatron.training.offload.gpu_tier_start import starting_gpu_tier_bytes
from mlp_offload import GiB

# The README's 20.68 B command (benchmarks/experiments/largest_model.sh), one H200.
LARGEST = ["--num-layers", "52", "--hidden-size", "6144", "--ffn-hidden-size", "16384", "--num-attention-heads", "48",
           "--num-query-groups", "8", "--group-query-attention", "--seq-length", "2048",
           "--max-position-embeddings", "2048", "--swiglu", "--normalization", "RMSNorm",
           "--position-embedding-type", "rope", "--untie-embeddings-and-output-weights", "--disable-bias-linear",
           "--vocab-size", "32000", "--micro-batch-size", "1", "--global-batch-size", "1", "--bf16",
           "--grad-reduce-in-bf16", "--recompute-granularity", "full", "--recompute-method", "uniform",
           "--recompute-num-layers", "1", "--train-iters", "1", "--lr", "3e-4", "--mock-data", "--device", "cpu"]


def _args():
    args = parse_args(LARGEST)
    args.padded_vocab_size = 32000
    return args, transformer_config(args)


def test_the_20b_run_starts_with_state_in_hbm_but_below_what_it_learnt():
    args, cfg = _args()
    # 136.8 GiB reachable on the H200, less the bf16 params and bf16 grads (2 x 38.5 GiB) and ~1 GiB of context
    free = int((136.8 - 2 * 20677515264 * 2 / GiB - 1.0) * GiB)
    start = starting_gpu_tier_bytes(args, cfg, free, 4 * GiB, data_parallel=1)
    learnt = 47.93 * GiB  # the tier after iteration 3 (docs/results/gpu_2026-11-26b/20b_overlap.log)
    assert 10 * GiB < start < learnt


def test_nothing_where_activations_and_margin_take_the_free_memory():
    args, cfg = _args()
    assert starting_gpu_tier_bytes(args, cfg, 5 * GiB, 4 * GiB, data_parallel=1) == 0
    # more free memory never starts smaller
    sizes = [starting_gpu_tier_bytes(args, cfg, f * GiB, 4 * GiB, data_parallel=1) for f in range(0, 80, 10)]
    assert sizes == sorted(sizes)


def test_the_start_flag_sets_the_start_and_needs_the_auto_tier():
    args, cfg = _args()
    args.offload_gpu_start_gb = 0.25
    assert starting_gpu_tier_bytes(args, cfg, 100 * GiB, 4 * GiB, data_parallel=1) == GiB // 4
    args.offload_gpu_start_gb = 0.0  # empty: every subgroup waits for the measured peak
    assert starting_gpu_tier_bytes(args, cfg, 100 * GiB, 4 * GiB, data_parallel=1) == 0
    offload = ["--offload-tiers", "gpu,host", "--offload-gpu-start-gb", "1"]
    assert parse_args([*LARGEST, *offload, "--offload-gpu-cache-gb", "auto"]).offload_gpu_start_gb == 1.0
    for fixed, given in ((["--offload-gpu-cache-gb", "8"], "8.0"), ([], "None")):
        with pytest.raises(UserError) as err:
            parse_args([*LARGEST, *offload, *fixed])
        assert str(err.value) == (f"argument --offload-gpu-start-gb: sizes an auto gpu tier; it needs "
                                  f"--offload-gpu-cache-gb auto (given: {given})")
