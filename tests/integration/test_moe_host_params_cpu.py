"""Mixture-of-experts models (megatron-core's MoE layers) on the layer-major step: layer inputs, params and grads in
host memory (--offload-activations host, --offload-params host, --offload-grads host) against megatron-core's own
schedule with full recompute and its DDP: every iteration's loss and grad norm bit for bit on the CPU.

With the grads in host memory each layer's slot is reduced as DDP reduces its buckets: the dense params' over the
data-parallel group, the experts' over the expert-data-parallel group with the experts' factor. At EP2 on two
ranks the dense grads are summed over DP 2 and the experts' only scaled (expert-DP 1); at EP2 on four ranks the
experts' are summed over expert-DP 2 too. The router's grads (and its aux losses' share in them) are the dense
params' (at TP2 with sequence parallelism summed over the tensor-parallel ranks after). Over pipeline stages the
stages without the loss set the aux losses' scale as megatron-core's forward_step does on every stage."""

import re

import pytest

from helpers import (LAYER_MAJOR_RUN, MOE, SEQUENCE_PARALLEL, assert_resume_repeats_the_run, offload_args,
                     run_variant)
from launch import run_pretrain
from tests.profiles import cases

EP2 = ["--expert-model-parallel-size", "2", "--moe-token-dispatcher-type", "alltoall"]
ACTIVATIONS = ["--offload-activations", "host"]
PARAMS = [*ACTIVATIONS, "--offload-params", "host"]
GRADS = ["--offload-params", "host", "--offload-grads", "host"]

# Routers and dispatchers the CPU runs, each at EP2 (two ranks: DP 2, expert-DP 1): (name, the model's flags, the
# layer-major step's own). CI draws two a run.
ROUTERS = cases([
    ("aux_loss", [], []),
    ("allgather_dispatcher", ["--moe-token-dispatcher-type", "allgather"], []),
    ("seq_aux_loss", ["--moe-router-load-balancing-type", "seq_aux_loss"], []),
    ("global_aux_loss", ["--moe-router-load-balancing-type", "global_aux_loss"], []),
    ("expert_bias_and_z_loss", ["--moe-router-load-balancing-type", "none", "--moe-router-score-function", "sigmoid",
                                "--moe-router-enable-expert-bias", "--moe-z-loss-coeff", "1e-3",
                                "--moe-router-dtype", "fp32"], []),
    ("shared_experts_mixed_layers", ["--moe-shared-expert-intermediate-size", "64", "--moe-layer-freq",
                                     "([0]+[1])*2"], []),
    ("passes_of_one_micro_batch", [], ["--offload-microbatch-group", "1"]),
], ci_keep=2)
AUX_LOSS = re.compile(r"\b((?:seq_|global_)?load_balancing_loss|z_loss): (\S+)")


def _aux_losses(run_dir) -> list:
    """The aux losses the router logged, each iteration's (name, value) in order."""
    return AUX_LOSS.findall((run_dir / "loss-0.out").read_text())


def _against_megatron_core(tmp_path, flags, runs, nproc=2, train_iters=3):
    """megatron-core's schedule on ``flags``, then each of ``runs`` (name -> extra flags) on the layer-major step:
    each one's iterations (loss, learning rate, grad norm) and logged aux losses must be the schedule's, bit for
    bit."""
    reference = run_pretrain(tmp_path / "schedule", flags, train_iters=train_iters, nproc=nproc)
    assert len(reference) == train_iters and reference[0]["loss"] != reference[-1]["loss"]  # it trained
    aux_losses = _aux_losses(tmp_path / "schedule")
    assert len(aux_losses) >= train_iters, aux_losses
    for name, extra in runs.items():
        assert run_pretrain(tmp_path / name, [*flags, *extra], train_iters=train_iters, nproc=nproc) == reference, name
        assert _aux_losses(tmp_path / name) == aux_losses, name


@pytest.mark.parametrize("name, router, layer_major", ROUTERS, ids=[name for name, _, _ in ROUTERS])
def test_moe_layers_in_host_memory_repeat_megatron_core_at_ep2(tmp_path, name, router, layer_major):
    """EP2 on two ranks: the layer inputs, then the params, then the params and grads in host memory."""
    flags = [*MOE, *EP2, *router, *LAYER_MAJOR_RUN, *offload_args(tmp_path / "state", tiers=("host",))]
    _against_megatron_core(tmp_path, flags, {"activations": [*ACTIVATIONS, *layer_major],
                                             "params": [*PARAMS, *layer_major], "grads": [*GRADS, *layer_major]})


def test_experts_summed_over_two_expert_data_parallel_ranks(tmp_path):
    """EP2 on four ranks (DP 4, expert-DP 2): the experts' grads summed over their expert-data-parallel pair, the
    dense ones over all four ranks (the same bits as DDP's reduce-scatter on these ranks)."""
    flags = [*MOE, *EP2, *LAYER_MAJOR_RUN, *offload_args(tmp_path / "state", tiers=("host",)),
             "--global-batch-size", "16"]
    _against_megatron_core(tmp_path, flags, {"grads": GRADS}, nproc=4)
    assert "EP=2 ETP=1 expert-DP=2" in (tmp_path / "grads" / "loss-0.out").read_text()


def test_router_summed_over_tensor_parallel_ranks_with_experts_over_expert_data_parallel_ranks(tmp_path):
    """TP2 with sequence parallelism and EP2 (ETP 1) on four ranks (DP 2, expert-DP 2), through the test's variant of
    pretrain_gpt.py that runs sequence parallelism on the CPU: the router's grads (each tensor-parallel rank's from
    its part of the sequence) summed over the tensor-parallel pair after the data-parallel sum, the experts' over
    their expert-data-parallel pair: every iteration bit for bit."""
    flags = [*MOE, *EP2, "--expert-tensor-parallel-size", "1", "--tensor-model-parallel-size", "2",
             "--sequence-parallel", *LAYER_MAJOR_RUN, *offload_args(tmp_path / "state", tiers=("host",))]
    resident = run_variant(SEQUENCE_PARALLEL, tmp_path / "resident", flags, 3, 4)
    grads = run_variant(SEQUENCE_PARALLEL, tmp_path / "grads", [*flags, *GRADS], 3, 4)
    assert grads == resident and len(resident) == 3 and resident[0]["loss"] != resident[2]["loss"]
    assert "EP=2 ETP=1 expert-DP=2" in (tmp_path / "grads" / "out.txt").read_text()


def test_moe_layers_over_two_pipeline_stages_repeat_megatron_core(tmp_path):
    """PP2, dense and MoE layers mixed (each stage has an MoE layer): the first stage, which runs no loss, scales
    its aux losses' gradients by the step's micro-batches as megatron-core's schedule does there (left unset, by 1:
    the grad norm differs from the first iteration)."""
    flags = [*MOE, "--pipeline-model-parallel-size", "2", "--moe-layer-freq", "([0]+[1])*2", *LAYER_MAJOR_RUN,
             *offload_args(tmp_path / "state", tiers=("host",))]
    _against_megatron_core(tmp_path, flags, {"activations": ACTIVATIONS, "params": PARAMS, "grads": GRADS})


def test_moe_params_and_grads_in_host_memory_save_and_resume_bit_for_bit(tmp_path):
    """EP2, params and grads in host memory, state over host and disk: a run saving at 2 and going on to 4, and a
    resume from its save at 2 alone, give iterations 3-4 bit for bit (dense and expert engines alike)."""
    state = offload_args(tmp_path / "state", tiers=("host", "nvme"), budget_gb="0.001")  # (both engines' least)
    assert_resume_repeats_the_run(tmp_path, [*MOE, *EP2, *LAYER_MAJOR_RUN, *state, *GRADS])
