"""The layer-major step (megatron/training/model/layer_major.py) against megatron-core's schedule with
full recompute: the same losses and every gradient bit for bit, from the same params and batches, on
the CPU over layouts of TP, PP and DP up to four ranks, in fp32 and bf16, DP ranks each with their own batches,
reduced by DDP as in training (layer_major_ranks.py does both passes in each rank); and pretrain_gpt.py runs
with layer inputs, params and grads in host memory against the same runs with them resident (with
--sequence-parallel through sequence_parallel_pretrain.py, its CPU variant)."""

import json

import pytest

from helpers import (LAYER_MAJOR_RUN, SEQUENCE_PARALLEL, assert_resume_repeats_the_run, copy_checkpoint, offload_args,
                     run_variant)
from launch import PRETRAIN, REPO, launch_command, pretrain_env, ranks_output, run_and_clean_up, run_pretrain
from tests.profiles import cases

RANKS = REPO / "tests" / "integration" / "layer_major_ranks.py"


# The configuration space: every layout of at most four ranks the tiny model takes (TP divides its 2 query
# groups), 1-3 micro-batches, fp32 (where each gradient's sum over micro-batches rounds, so its order shows) and
# bf16. CI draws a few each run (tests/profiles.py), the thorough profile runs them all.
LAYOUTS = [(tp, pp, dp) for tp in (1, 2) for pp in (1, 2, 4) for dp in (1, 2, 4) if tp * pp * dp <= 4]
STEP_CASES = cases([(tp * pp * dp, tp, m, precision, pp) for tp, pp, dp in LAYOUTS for m in (1, 2, 3)
                    for precision in ("fp32", "bf16")], ci_keep=4)


@pytest.mark.parametrize("ranks, tp, micro_batches, precision, pp", STEP_CASES,
                         ids=[f"tp{tp}-pp{pp}-dp{r // (tp * pp)}-{m}mb-{p}" for r, tp, m, p, pp in STEP_CASES])
def test_layer_major_step_equals_megatron_cores_schedule(tmp_path, ranks, tp, micro_batches, precision, pp):
    """Against megatron-core's schedule for the layout (1F1B above one pipeline stage, whose losses are the last
    stage's); DP ranks each with their own batches."""
    cmd = launch_command([str(tmp_path), str(tp), str(micro_batches), precision, str(pp)], ranks, warm=True,
                         script=RANKS)
    code, output = run_and_clean_up(cmd, pretrain_env(), 240, tmp_path / "out.txt")
    assert code == 0, output[-4000:]
    last_stage = range(ranks - ranks // pp, ranks)  # megatron-core's rank order: tp, then dp, then pp
    for rank in range(ranks):
        result = json.loads((tmp_path / f"rank{rank}.json").read_text())
        assert len(result["losses"]) == (micro_batches if rank in last_stage else 0), result
        assert result["losses"] == result["reference_losses"], result
        assert result["nonzero_grads"] > result["grad_elements"] // 2, result  # a real backward reached them
        assert result["grads_equal"], result
        # Each layer brought in for its forward and again for its backward, its params away otherwise, its
        # inputs kept in host memory: the same bits.
        assert result["calls_in_order"], result
        assert result["streamed_losses"] == result["reference_losses"] and result["streamed_grads_equal"], result


def test_configurations_it_cannot_run_are_refused_in_one_line():
    from types import SimpleNamespace

    from megatron.training.model.layer_major import layer_major_refusal

    good = dict(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1,
                hidden_dropout=0.0, attention_dropout=0.0, fp8=None)
    assert layer_major_refusal(SimpleNamespace(**good), 1) is None
    for change, words in ((dict(recompute_granularity="selective"), "--recompute-granularity full"),
                          (dict(recompute_num_layers=2), "--recompute-num-layers 1"),
                          (dict(hidden_dropout=0.1), "--hidden-dropout 0.1"), (dict(fp8="e4m3"), "fp8")):
        line = layer_major_refusal(SimpleNamespace(**{**good, **change}), 1)
        assert words in line and "\n" not in line
    assert "one model chunk per pipeline stage (2" in layer_major_refusal(SimpleNamespace(**good), 2)


def test_training_with_activations_in_host_memory_repeats_the_run_without(tmp_path):
    """pretrain_gpt.py with --offload-activations host (the layer-major step, layer inputs in host memory),
    DP2, two micro-batches per rank, the optimizer state offloaded: every iteration's loss and grad norm
    equal those of the same run on megatron-core's schedule, bit for bit."""
    flags = [*LAYER_MAJOR_RUN, *offload_args(tmp_path / "state", tiers=("host",))]
    schedule = run_pretrain(tmp_path / "schedule", flags, train_iters=3)
    layer_major = run_pretrain(tmp_path / "layer_major", [*flags, "--offload-activations", "host"], train_iters=3)
    assert [(r["loss"], r["grad_norm"]) for r in layer_major] == [(r["loss"], r["grad_norm"]) for r in schedule]
    assert len(schedule) == 3 and schedule[0]["loss"] != schedule[-1]["loss"]  # it trained


@pytest.mark.parametrize("flags, flag, words", [
    (["--offload-activations", "host"], "--offload-activations host", "--recompute-granularity full"),
    (["--offload-microbatch-group", "2"], "--offload-microbatch-group", "needs the layer-major step")])
def test_a_run_it_cannot_take_stops_in_one_line_before_the_model(tmp_path, flags, flag, words):
    # under torchrun, without its own report of the failure
    output = ranks_output(run_pretrain(tmp_path, flags, train_iters=1, expect_success=False)[0]["output"])
    lines = [line for line in output.splitlines() if f"error: {flag}:" in line]
    assert len(lines) == 1 and words in lines[0], output[-3000:]
    assert "Traceback" not in output


def test_training_with_params_in_host_memory_repeats_the_run_with_them_resident(tmp_path):
    """--offload-params host (DDP's param buffer in host memory, each layer's params copied into a device
    slot for its forward and again for its backward, the rest for the whole step) with the evaluation's
    forward-only step too: losses, grad norms and validation losses equal those of the same layer-major run
    with the params resident, bit for bit (on the CPU the copies go host to host: the CPU twin)."""
    flags = [*LAYER_MAJOR_RUN, *offload_args(tmp_path / "state", tiers=("host",)), "--offload-activations", "host",
             "--eval-interval", "2", "--eval-iters", "1", "--tensor-model-parallel-size", "2"]
    resident = run_pretrain(tmp_path / "resident", flags, train_iters=4)
    on_host = run_pretrain(tmp_path / "on_host", [*flags, "--offload-params", "host"], train_iters=4)
    # and the grads there too: each layer's summed in a slot during its backward, its norm taken there
    grads = run_pretrain(tmp_path / "grads", [*flags, "--offload-params", "host", "--offload-grads", "host"],
                         train_iters=4)
    for run in (on_host, grads):
        assert [(r["loss"], r["grad_norm"]) for r in run] == [(r["loss"], r["grad_norm"]) for r in resident]
    assert len(resident) == 4 and resident[0]["loss"] != resident[3]["loss"]  # it trained
    validation = [_validation_lines(tmp_path / run) for run in ("resident", "on_host", "grads")]
    assert len(validation[0]) == 2 and validation[1] == validation[0] == validation[2], validation
    assert "pinned" not in (tmp_path / "on_host" / "loss-0.out").read_text()  # no pinning on the CPU
    assert "> params:" in (tmp_path / "on_host" / "loss-0.out").read_text()
    assert "of grads there too" in (tmp_path / "grads" / "loss-0.out").read_text()


def test_params_in_host_memory_at_two_data_parallel_ranks_repeat_the_run_with_them_resident(tmp_path):
    """--offload-params host at DP2: each rank updates its shard of the host buffer and the shards are gathered
    through the device (gather_params_through), the start's broadcast likewise: every iteration's loss and grad
    norm equal the same run's with the params resident, bit for bit. With --offload-grads host too, each layer's
    gradient slot is scaled and summed over the two ranks as DDP's reduce-scatter sums the bucket, and each rank's
    norm taken over its shard's part: the same bits again."""
    flags = [*LAYER_MAJOR_RUN, *offload_args(tmp_path / "state", tiers=("host",)), "--offload-activations", "host",
             "--global-batch-size", "8"]
    resident = run_pretrain(tmp_path / "resident", flags, train_iters=3)
    on_host = run_pretrain(tmp_path / "on_host", [*flags, "--offload-params", "host"], train_iters=3)
    assert [(r["loss"], r["grad_norm"]) for r in on_host] == [(r["loss"], r["grad_norm"]) for r in resident]
    grads = run_pretrain(tmp_path / "grads", [*flags, "--offload-params", "host", "--offload-grads", "host"],
                         train_iters=3)
    assert [(r["loss"], r["grad_norm"]) for r in grads] == [(r["loss"], r["grad_norm"]) for r in resident]
    assert len(resident) == 3 and resident[0]["loss"] != resident[2]["loss"]


def test_two_pipeline_stages_layer_major_repeat_megatron_cores_pipeline_schedule(tmp_path):
    """PP2 (two ranks, three micro-batches): megatron-core's 1F1B schedule with full recompute, the layer-major
    step with the layer inputs in host memory, and with the params (and then the grads) there too: every
    iteration's loss and grad norm bit for bit, and the evaluation's forward-only steps likewise."""
    flags = [*LAYER_MAJOR_RUN, *offload_args(tmp_path / "state", tiers=("host",)), "--pipeline-model-parallel-size",
             "2", "--num-layers", "4", "--global-batch-size", "6", "--eval-interval", "2", "--eval-iters", "1"]
    runs = {"schedule": [], "inputs": ["--offload-activations", "host"],
            "params": ["--offload-activations", "host", "--offload-params", "host"],
            "grads": ["--offload-params", "host", "--offload-grads", "host"]}
    results = {name: run_pretrain(tmp_path / name, [*flags, *extra], train_iters=3) for name, extra in runs.items()}
    reference = [(r["loss"], r["grad_norm"]) for r in results["schedule"]]
    assert len(reference) == 3 and reference[0][0] != reference[-1][0]  # it trained
    for name in ("inputs", "params", "grads"):
        assert [(r["loss"], r["grad_norm"]) for r in results[name]] == reference, name
    validation = [_validation_lines(tmp_path / name) for name in runs]
    assert len(validation[0]) == 1 and all(v == validation[0] for v in validation), validation


@pytest.mark.parametrize("layout", [["--tensor-model-parallel-size", "2"],
                                    ["--pipeline-model-parallel-size", "2", "--num-layers", "4"],
                                    ["--tensor-model-parallel-size", "1", "--global-batch-size", "8"]],
                         ids=["tp2", "pp2", "dp2"])
def test_params_in_host_memory_save_and_resume_bit_for_bit(tmp_path, layout):
    """--offload-params host and --offload-grads host, state over host and disk: a run saving at 2 and going on
    to 4, and a resume from its save at 2 alone, give iterations 3-4 bit for bit (the params come back into the
    host buffer), at TP2, over two pipeline stages, and at DP2 (each rank's shard of the grads reduced from the
    device slots, of the params gathered through the device)."""
    flags = [*LAYER_MAJOR_RUN, *offload_args(tmp_path / "state", tiers=("host", "nvme")), "--offload-params", "host",
             "--offload-grads", "host", *layout]
    assert_resume_repeats_the_run(tmp_path, flags)


def _saved_tensors(iteration_dir) -> dict:
    """The tensors of a torch_dist checkpoint (the model's under their global keys), read back by torch's own
    converter (no Megatron code)."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save
    import torch

    converted = iteration_dir.parent / f"{iteration_dir.name}.pt"
    dcp_to_torch_save(str(iteration_dir), str(converted))
    return {key: value for key, value in torch.load(converted, weights_only=False).items()
            if isinstance(value, torch.Tensor)}


# Params in host memory, params and grads there too, and the latter at DP2 (the updated shards gathered through
# the device); CI draws one a run.
ASYNC_LAYOUTS = cases([("params", ["--offload-params", "host"]),
                       ("params-grads", ["--offload-params", "host", "--offload-grads", "host"]),
                       ("params-grads-dp2", ["--offload-params", "host", "--offload-grads", "host",
                                             "--tensor-model-parallel-size", "1", "--global-batch-size", "8"])],
                      ci_keep=1)


@pytest.mark.parametrize("name, extra", ASYNC_LAYOUTS, ids=[name for name, _ in ASYNC_LAYOUTS])
def test_params_in_host_memory_async_save_and_resume_bit_for_bit(tmp_path, name, extra):
    """--async-save with the params in host memory: the save at 2 copies the params it writes aside, and the
    writer writes them while iterations 3-4 update the host buffers in place. The checkpoint holds the params of
    iteration 2 as a synchronous save writes them (read back by torch's converter), the run trains as the one
    saving synchronously, and a resume from the save at 2 alone gives iterations 3-4 bit for bit."""
    flags = [*LAYER_MAJOR_RUN, *offload_args(tmp_path / "state", tiers=("host", "nvme")), *extra]
    saving = ["--save-interval", "2"]
    whole = run_pretrain(tmp_path / "whole", [*flags, "--save", str(tmp_path / "ckpt"), *saving, "--async-save"],
                         train_iters=4)
    sync = run_pretrain(tmp_path / "sync", [*flags, "--save", str(tmp_path / "sync_ckpt"), *saving], train_iters=4)
    assert whole == sync and whole[0]["loss"] != whole[-1]["loss"]
    at2 = copy_checkpoint(tmp_path / "ckpt", [2], tmp_path / "at2")
    resumed = run_pretrain(tmp_path / "resumed", [*flags, "--load", str(at2)], train_iters=4)
    assert [r["iteration"] for r in resumed] == [3, 4]
    assert resumed == [r for r in whole if r["iteration"] > 2]
    written, reference = (_saved_tensors(root / "iter_0000002") for root in (at2, tmp_path / "sync_ckpt"))
    assert written.keys() == reference.keys() and any(key.startswith("decoder.layers.") for key in written)
    assert all(torch_equal(written[key], reference[key]) for key in reference), name
    output = (tmp_path / "whole" / "loss-0.out").read_text()
    assert "each save copies about" in output and "of params in host memory copied aside in " in output


def torch_equal(a, b) -> bool:
    import torch

    return a.dtype == b.dtype and torch.equal(a, b)


# Grads megatron-core's finalize sums over the tensor-parallel ranks: the norms' under --sequence-parallel (at DP1
# and DP2) and the query and key norms'. CI draws one a run.
TP_SUMMED = cases([("tp2-sp", 2, "--sequence-parallel"), ("tp2-sp-dp2", 4, "--sequence-parallel"),
                   ("tp2-qk-layernorm", 2, "--qk-layernorm")], ci_keep=1)


@pytest.mark.parametrize("name, nproc, flag", TP_SUMMED, ids=[name for name, _, _ in TP_SUMMED])
def test_grads_in_host_memory_summed_over_tensor_parallel_ranks_repeat_megatron_core(tmp_path, name, nproc, flag):
    """--offload-grads host where the finalize sums grads over the tensor-parallel ranks: each layer's are summed in
    its slot after the data-parallel sum and hidden from the finalize. Every iteration's loss and grad norm equal
    those of megatron-core's schedule with everything resident, bit for bit (left in host memory for the finalize,
    the grad norms differ from the first iteration; summed twice, the losses from the second)."""
    script = SEQUENCE_PARALLEL if flag == "--sequence-parallel" else PRETRAIN
    flags = [*LAYER_MAJOR_RUN, *offload_args(tmp_path / "state", tiers=("host",)), "--tensor-model-parallel-size",
             "2", flag]
    resident = run_variant(script, tmp_path / "resident", flags, 3, nproc)
    grads = run_variant(script, tmp_path / "grads", [*flags, "--offload-params", "host", "--offload-grads", "host"], 3,
                        nproc)
    assert [(r["loss"], r["grad_norm"]) for r in grads] == [(r["loss"], r["grad_norm"]) for r in resident]
    assert len(resident) == 3 and resident[0]["loss"] != resident[2]["loss"]  # it trained


def _validation_lines(run_dir) -> list:
    return [line.strip() for line in (run_dir / "loss-0.out").read_text().splitlines()
            if "validation loss at iteration" in line]


@pytest.mark.parametrize("flags, words, flag", [
    (["--offload-overlap-forward"], "--offload-overlap-forward", "--offload-params host"),
    (["--offload-grads", "host", "--tensor-model-parallel-size", "1", "--pipeline-model-parallel-size", "2",
      "--num-layers", "4"], "--untie-embeddings-and-output-weights", "--offload-grads host"),  # tied (below)
    (["--offload-grads", "host", "--offload-params", "none"], "needs --offload-params host", "--offload-grads host"),
    (["--offload-grads", "host", "--calculate-per-token-loss"], "--calculate-per-token-loss", "--offload-grads host"),
    (["--overlap-grad-reduce", "--tensor-model-parallel-size", "1"], "--overlap-grad-reduce", "--offload-params host"),
])
def test_params_in_host_memory_refuse_what_they_cannot_run_in_one_line(tmp_path, flags, words, flag):
    base = [*LAYER_MAJOR_RUN, *offload_args(tmp_path / "state", tiers=("host",)), "--offload-params", "host"]
    if "--pipeline-model-parallel-size" in flags:  # the embedding tied to the output layer on the other stage
        base.remove("--untie-embeddings-and-output-weights")
    if "--tensor-model-parallel-size" not in flags:
        base += ["--tensor-model-parallel-size", "2"]
    output = ranks_output(run_pretrain(tmp_path, [*base, *flags], train_iters=1, expect_success=False)[0]["output"])
    lines = [line for line in output.splitlines() if f"error: {flag}:" in line]
    assert len(lines) == 1 and words in lines[0], output[-3000:]
    assert "Traceback" not in output


# Passes of a group of micro-batches (of 2 samples): at DP2 (two ranks, 5 micro-batches each: passes of 2, 2, 1) and
# over two pipeline stages (6 micro-batches: passes of 4 and 2); CI draws one, the thorough profile runs both.
GROUP_LAYOUTS = cases([("dp2", ["--global-batch-size", "20"], "2"),
                       ("pp2", ["--pipeline-model-parallel-size", "2", "--num-layers", "4", "--global-batch-size", "12"],
                        "4")], ci_keep=1)


@pytest.mark.parametrize("name, layout, group", GROUP_LAYOUTS, ids=[name for name, _, _ in GROUP_LAYOUTS])
def test_the_step_in_passes_of_a_group_of_micro_batches_repeats_megatron_core(tmp_path, name, layout, group):
    """--offload-microbatch-group N: each layer runs for N micro-batches before the next, the step in passes (the
    last one shorter where N does not divide the step's micro-batches); each gradient still sums the step's
    micro-batches in their order (with the grads in host memory each pass's partial sums go out and come back for
    the next pass): every iteration's loss and grad norm equal megatron-core's schedule's, bit for bit, with the
    layer inputs, the params and the grads in host memory."""
    flags = [*LAYER_MAJOR_RUN, *offload_args(tmp_path / "state", tiers=("host",)), *layout]
    grouped = ["--offload-microbatch-group", group]
    runs = {"schedule": [], "inputs": ["--offload-activations", "host", *grouped],
            "params": ["--offload-activations", "host", "--offload-params", "host", *grouped],
            "grads": ["--offload-params", "host", "--offload-grads", "host", *grouped]}
    results = {run: run_pretrain(tmp_path / run, [*flags, *extra], train_iters=3) for run, extra in runs.items()}
    reference = [(r["loss"], r["grad_norm"]) for r in results["schedule"]]
    assert len(reference) == 3 and reference[0][0] != reference[-1][0]  # it trained
    for run in ("inputs", "params", "grads"):
        assert [(r["loss"], r["grad_norm"]) for r in results[run]] == reference, run
    startup = (tmp_path / "grads" / "loss-0.out").read_text()
    assert f"for {group} micro-batches at a time" in startup, startup[-2000:]


def test_an_uneven_pipeline_split_from_megatron_lms_flag_repeats_megatron_cores_schedule(tmp_path):
    """--decoder-first-pipeline-num-layers 1 over two pipeline stages of 3 layers (1 and 2): megatron-core's 1F1B
    schedule, and the layer-major step with the params and grads in host memory, bit for bit."""
    flags = [*LAYER_MAJOR_RUN, *offload_args(tmp_path / "state", tiers=("host",)), "--pipeline-model-parallel-size",
             "2", "--num-layers", "3", "--decoder-first-pipeline-num-layers", "1", "--global-batch-size", "6"]
    runs = {"schedule": [], "grads": ["--offload-params", "host", "--offload-grads", "host"]}
    results = {name: run_pretrain(tmp_path / name, [*flags, *extra], train_iters=3) for name, extra in runs.items()}
    reference = [(r["loss"], r["grad_norm"]) for r in results["schedule"]]
    assert len(reference) == 3 and reference[0][0] != reference[-1][0]  # it trained
    assert [(r["loss"], r["grad_norm"]) for r in results["grads"]] == reference
