"""Flag parsing: offload group (generic per-tier paths) and clear errors naming the flag."""

import subprocess
import sys

import pytest

from launch import REPO
from megatron.training.args.arguments import parse_args
from megatron.training.errors import UserError

BASE = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "32",
        "--micro-batch-size", "1", "--train-iters", "1", "--lr", "1e-3", "--mock-data"]


def test_defaults():
    args = parse_args(BASE)
    assert args.offload_tiers is None and args.offload_paths == {}
    assert args.offload_adam_kernel is None  # no offload: no kernel
    # With offload: the kernel megatron-core's optimizer runs on a CPU device, the fastest on a GPU
    assert parse_args(BASE + ["--offload-tiers", "host", "--device", "cpu"]).offload_adam_kernel == "single"
    assert parse_args(BASE + ["--offload-tiers", "host", "--device", "cuda"]).offload_adam_kernel == "fused"
    assert parse_args(BASE + ["--offload-tiers", "host", "--device", "cpu",
                              "--offload-adam-kernel", "fused"]).offload_adam_kernel == "fused"
    # Megatron-LM's defaults; an optimizer offload implies the distributed optimizer
    assert not args.use_distributed_optimizer and args.log_interval == 100 and args.num_workers == 2
    assert parse_args(BASE + ["--offload-tiers", "host"]).use_distributed_optimizer
    assert args.offload_subgroup_size == 100_000_000 and args.offload_prefetch_depth == 2
    assert args.max_position_embeddings == 32 and args.lr_decay_iters == 1


def test_offload_paths_for_any_tier_name():
    args = parse_args(BASE + ["--offload-tiers", "host,nvme,scratch2", "--offload-nvme-path", "/a",
                              "--offload-scratch2-path=/b", "--offload-host-cache-gb", "1.5",
                              "--offload-bandwidths", "nvme=3.0:2.8,scratch2=1:0.8",
                              "--offload-adam-kernel", "foreach", "--offload-no-cache",
                              "--offload-cpu-threads", "4"])
    assert args.offload_tiers == ["host", "nvme", "scratch2"]
    assert args.offload_paths == {"nvme": "/a", "scratch2": "/b"}
    assert args.offload_host_cache_gb == 1.5 and args.offload_no_cache and args.offload_cpu_threads == 4


@pytest.mark.parametrize("extra, flag", [
    (["--offload-tiers", "host,nvme"], "--offload-nvme-path"),
    (["--offload-tiers", "host", "--offload-pfs-path", "/x"], "--offload-pfs-path"),
    (["--offload-nvme-path", "/x"], "--offload-nvme-path"),
    (["--offload-tiers", "nvme", "--offload-nvme-path"], "--offload-nvme-path"),
    (["--offload-tiers", "host,,host"], "--offload-tiers"),
    (["--offload-tiers", "nvme", "--offload-nvme-path", "/x", "--offload-bandwidths", "nvme=fast"],
     "--offload-bandwidths"),
    (["--offload-tiers", "nvme", "--offload-nvme-path", "/x", "--offload-token-scope", "nvme=rack"],
     "--offload-token-scope nvme must be 'node' or 'job'"),
    (["--offload-adam-kernel", "turbo"], "--offload-adam-kernel"),
    (["--offload-io-threads", "0"], "--offload-io-threads"),
    (["--offload-tiers", "host", "--offload-host-cache-gb", "inf"], "--offload-host-cache-gb"),
    (["--pipeline-model-parallel-size", "3"], "--pipeline-model-parallel-size"),
    (["--bf16", "--fp16"], "--fp16"),
    (["--no-such-flag"], "--no-such-flag"),
])
def test_bad_flags_name_the_flag(extra, flag):
    with pytest.raises(UserError, match=flag):
        parse_args(BASE + extra)


def test_cli_error_has_no_traceback():
    done = subprocess.run([sys.executable, str(REPO / "pretrain_gpt.py"), *BASE,
                           "--offload-tiers", "host,nvme"], capture_output=True, text=True, cwd=REPO,
                          timeout=120)
    assert done.returncode == 2
    assert "--offload-nvme-path" in done.stderr and "Traceback" not in done.stderr


def test_mcore_cpu_offload_pass_through():
    args = parse_args(BASE + ["--device", "cuda", "--optimizer-cpu-offload", "--optimizer-offload-fraction", "0.5",
                              "--overlap-cpu-optimizer-d2h-h2d", "--timing-log", "/tmp/t.jsonl"])
    assert args.optimizer_cpu_offload and args.optimizer_offload_fraction == 0.5
    assert args.overlap_cpu_optimizer_d2h_h2d and args.timing_log == "/tmp/t.jsonl"
    from megatron.training.model.configs import optimizer_config

    config = optimizer_config(args)
    assert config.optimizer_cpu_offload and config.optimizer_offload_fraction == 0.5
    assert config.overlap_cpu_optimizer_d2h_h2d
    assert not optimizer_config(parse_args(BASE)).optimizer_cpu_offload


@pytest.mark.parametrize("extra, message", [
    (["--device", "cuda", "--optimizer-cpu-offload", "--offload-tiers", "host"], "not allowed with --offload-tiers"),
    (["--device", "cpu", "--optimizer-cpu-offload"], "needs a CUDA device"),
    (["--device", "cuda", "--optimizer-cpu-offload", "--optimizer-offload-fraction", "1.5"],
     "--optimizer-offload-fraction"),
    (["--overlap-cpu-optimizer-d2h-h2d"], "requires --optimizer-cpu-offload"),
])
def test_mcore_cpu_offload_errors(extra, message):
    with pytest.raises(UserError) as exc:
        parse_args(BASE + extra)
    assert message in str(exc.value) and "--optimizer" in str(exc.value)


@pytest.mark.parametrize("engine_says, user_reads", [
    ("host budget 0.004 GiB (host_budget_bytes=4194304) is below the pipeline's minimum; raise host_budget_bytes "
     "or lower subgroup_size",
     "host budget 0.004 GiB (--offload-host-cache-gb 0.00390625) is below the pipeline's minimum; raise "
     "--offload-host-cache-gb or lower --offload-subgroup-size"),
    ("paths['nvme'] /x: the directory does not exist", "--offload-nvme-path /x: the directory does not exist"),
    ("bandwidths 'nvme=x': expected TIER=READ_GBPS:WRITE_GBPS", "--offload-bandwidths 'nvme=x': expected "
                                                                "TIER=READ_GBPS:WRITE_GBPS"),
    ("cannot split probe_bytes=1048576 into prefetch_depth=129 files",
     "cannot split --offload-probe-mb 1 into --offload-prefetch-depth 129 files"),
    ("the offload tiers and their file tiers", "the offload tiers and their file tiers"),  # prose stays
])
def test_engine_fields_read_as_flags(engine_says, user_reads):
    from megatron.training.offload.options import in_flags

    assert in_flags(engine_says) == user_reads


def test_no_flag_strings_in_the_engine():
    """The engine names config fields; only the Megatron layer speaks the command line."""
    offenders = [f"{p.relative_to(REPO)}:{n}" for p in (REPO / "mlp_offload").rglob("*.py")
                 for n, line in enumerate(p.read_text().splitlines(), 1) if "--offload" in line]
    assert offenders == []


def test_megatron_logging_flags():
    args = parse_args(BASE + ["--log-throughput", "--timing-log-level", "2", "--timing-log-option", "all",
                              "--tensorboard-dir", "/tb", "--tensorboard-log-interval", "5",
                              "--tensorboard-queue-size", "10", "--log-timers-to-tensorboard",
                              "--log-validation-ppl-to-tensorboard", "--log-memory-to-tensorboard",
                              "--log-params-norm", "--log-num-zeros-in-grad", "--no-log-loss-scale-to-tensorboard",
                              "--wandb-project", "p", "--wandb-exp-name", "e", "--wandb-save-dir", "/w"])
    assert args.log_throughput and args.timing_log_level == 2 and args.timing_log_option == "all"
    assert (args.tensorboard_dir, args.tensorboard_log_interval, args.tensorboard_queue_size) == ("/tb", 5, 10)
    assert args.log_timers_to_tensorboard and args.log_validation_ppl_to_tensorboard and args.log_memory_to_tensorboard
    assert args.log_params_norm and args.log_num_zeros_in_grad and not args.log_loss_scale_to_tensorboard
    assert (args.wandb_project, args.wandb_exp_name, args.wandb_save_dir) == ("p", "e", "/w")


@pytest.mark.parametrize("extra, flag", [
    (["--wandb-project", "p", "--wandb-save-dir", "/w"], "--wandb-project"),
    (["--wandb-project", "p", "--wandb-exp-name", "e"], "--wandb-project"),
    (["--timing-log-level", "3"], "--timing-log-level"),
])
def test_logging_flag_errors_name_the_flag(extra, flag):
    with pytest.raises(UserError, match=flag):
        parse_args(BASE + extra)


def test_precision_aware_dtypes_go_to_the_offload_engine_not_megatron_core():
    from megatron.training.offload.flags import config_from_args
    from megatron.training.model.configs import optimizer_config

    args = parse_args(BASE + ["--offload-tiers", "host", "--use-precision-aware-optimizer",
                              "--main-params-dtype", "fp16", "--exp-avg-dtype", "bf16"])
    assert config_from_args(args, rank=0).state_dtypes == ("fp16", "bf16", "fp32")
    assert not optimizer_config(args).use_precision_aware_optimizer  # megatron-core would demand TE
    assert config_from_args(parse_args(BASE + ["--offload-tiers", "host"]), rank=0).state_dtypes == ("fp32",) * 3


@pytest.mark.parametrize("extra, remainders", [
    (["--bf16"], True),  # the default: the fp32 master's low halves beside the bf16 params
    (["--bf16", "--no-store-param-remainders"], False),
    (["--fp16"], False), ([], False),  # nothing bf16 to complete
    (["--bf16", "--use-precision-aware-optimizer", "--main-params-dtype", "fp16"], False),  # no fp32 master
    (["--bf16", "--use-precision-aware-optimizer", "--exp-avg-dtype", "bf16"], True),
])
def test_param_remainders_default_on_with_bf16_and_an_fp32_master(extra, remainders):
    from megatron.training.offload.flags import config_from_args

    config = config_from_args(parse_args(BASE + ["--offload-tiers", "host", *extra]), rank=0)
    assert config.param_remainders is remainders
    assert config.stored_dtypes[0] == ("rem16" if remainders else config.state_dtypes[0])


@pytest.mark.parametrize("flags, on_model, one_pass", [
    ([], True, True),
    (["--offload-no-update-in-model-buffers"], False, True),
    (["--offload-no-one-pass-update"], True, False),  # (the model's buffers are the one-pass kernel's: unused then)
])
def test_the_device_update_paths_follow_their_flags(flags, on_model, one_pass):
    from megatron.training.offload.flags import config_from_args

    config = config_from_args(parse_args(BASE + ["--offload-tiers", "host", *flags]), rank=0)
    assert (config.device_model_buffers, config.device_one_pass) == (on_model, one_pass)


def test_no_store_param_remainders_reaches_megatron_core_where_it_honours_it():
    """megatron-core keeps remainders only in transformer-engine's FusedAdam of the precision-aware
    optimizer: there the flag is passed; elsewhere its OptimizerConfig default stays."""
    from megatron.training.model.precision_aware import optimizer_config_fields

    args = parse_args(BASE + ["--bf16", "--no-store-param-remainders"])
    assert optimizer_config_fields(args) == {}
    args.use_precision_aware_optimizer = True  # as parsed on a machine with transformer-engine
    assert optimizer_config_fields(args)["store_param_remainders"] is False


@pytest.mark.parametrize("extra, message", [
    (["--exp-avg-dtype", "bf16"], "argument --exp-avg-dtype: requires --use-precision-aware-optimizer"),
    (["--use-precision-aware-optimizer", "--offload-tiers", "host", "--exp-avg-sq-dtype", "fp8"],
     "the moments' state dtypes (--exp-avg-dtype, --exp-avg-sq-dtype) are fp32/fp8: fp8 moments are updated "
     "together in one kernel, so both are fp8 or neither is"),
    (["--use-precision-aware-optimizer", "--device", "cpu", "--use-distributed-optimizer"],
     "argument --use-precision-aware-optimizer: megatron-core's optimizer needs transformer-engine's FusedAdam"),
])
def test_precision_aware_errors_name_the_flag(extra, message):
    with pytest.raises(UserError) as exc:
        parse_args(BASE + extra)
    assert message in str(exc.value)
