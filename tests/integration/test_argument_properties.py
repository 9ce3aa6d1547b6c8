"""Random flag combinations: each either fails in parse_args with one UserError naming a flag, or
builds megatron-core's TransformerConfig, OptimizerConfig and OptimizerParamScheduler without the
bare AssertionError/ValueError megatron-core would raise later, deep inside a job."""

from types import SimpleNamespace

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from megatron.training.args.arguments import parse_args
from megatron.training.errors import UserError

NUMBERS = st.sampled_from(["0", "1", "2", "3", "4", "8", "16", "64", "-1", "0.5", "1e-3", "nan", "inf", "1.5"])
FLAGS = {
    "--num-layers": NUMBERS, "--hidden-size": NUMBERS, "--num-attention-heads": NUMBERS,
    "--num-query-groups": NUMBERS, "--ffn-hidden-size": NUMBERS, "--seq-length": NUMBERS,
    "--max-position-embeddings": NUMBERS, "--micro-batch-size": NUMBERS, "--global-batch-size": NUMBERS,
    "--train-iters": NUMBERS, "--lr": NUMBERS, "--min-lr": NUMBERS, "--lr-warmup-iters": NUMBERS,
    "--lr-decay-iters": NUMBERS, "--weight-decay": NUMBERS, "--adam-beta1": NUMBERS, "--adam-beta2": NUMBERS,
    "--adam-eps": NUMBERS, "--clip-grad": NUMBERS, "--hidden-dropout": NUMBERS, "--attention-dropout": NUMBERS,
    "--init-method-std": NUMBERS, "--tensor-model-parallel-size": NUMBERS,
    "--pipeline-model-parallel-size": NUMBERS, "--offload-host-cache-gb": NUMBERS,
    "--offload-subgroup-size": NUMBERS, "--offload-prefetch-depth": NUMBERS, "--offload-probe-mb": NUMBERS,
    "--num-layers-per-virtual-pipeline-stage": NUMBERS, "--num-virtual-stages-per-pipeline-rank": NUMBERS,
    "--microbatch-group-size-per-virtual-pipeline-stage": NUMBERS,
    "--lr-decay-style": st.sampled_from(["constant", "linear", "cosine"]),
}
REQUIRED = {"--num-layers": "4", "--hidden-size": "64", "--num-attention-heads": "4", "--seq-length": "32",
            "--micro-batch-size": "1", "--train-iters": "10", "--lr": "1e-3"}


@st.composite
def command_lines(draw):
    chosen = draw(st.dictionaries(st.sampled_from(sorted(FLAGS)), st.none(), max_size=6))
    values = dict(REQUIRED)
    for flag in chosen:
        values[flag] = draw(FLAGS[flag])
    argv = ["--mock-data", "--bf16"]
    if "--offload-host-cache-gb" in values or draw(st.booleans()):
        argv += ["--offload-tiers", "host"]
    if draw(st.booleans()):
        argv += ["--no-overlap-p2p-communication"]
    for flag, value in values.items():
        argv += [flag, value]
    return argv


@settings(max_examples=300, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow])
@given(command_lines())
def test_flags_fail_up_front_or_build_megatron_core_objects(argv):
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

    from megatron.training.model.configs import optimizer_config, transformer_config
    from megatron.training.training import build_scheduler

    try:
        args = parse_args(argv)
    except UserError as err:
        message = str(err)
        assert "\n" not in message and "--" in message, message
        return
    args.global_batch_size = args.global_batch_size or args.micro_batch_size
    transformer_config(args)
    optimizer_config(args)
    fake = SimpleNamespace(param_groups=[{"lr": args.lr, "weight_decay": args.weight_decay}])
    assert isinstance(build_scheduler(args, fake), OptimizerParamScheduler)
