"""The interleaved (virtual) pipeline's flags: the size Megatron-LM derives from them, and the number
of micro-batches per step its schedule takes, checked at start-up in one line. (Bad combinations of
the flags themselves are among test_megatron_lm_flags' one-line errors; runs in test_virtual_pipeline_cpu.)"""

import pytest

from megatron.training.data import batch_schedule
from megatron.training.args.arguments import parse_args
from megatron.training.errors import UserError
from megatron.training.model.configs import transformer_config

BASE = ["--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "32", "--micro-batch-size", "1",
        "--train-iters", "10", "--lr", "1e-3", "--mock-data", "--device", "cpu"]


@pytest.mark.parametrize("extra, size", [
    (["--num-layers-per-virtual-pipeline-stage", "2"], 3),
    (["--num-layers-per-virtual-pipeline-stage", "6"], None),  # one chunk per rank: no interleaving, as upstream
    (["--num-virtual-stages-per-pipeline-rank", "6"], 6),
    (["--num-virtual-stages-per-pipeline-rank", "1"], None),
    ([], None),
])
def test_virtual_pipeline_size_as_megatron_lm_derives_it(extra, size):
    args = parse_args([*BASE, "--num-layers", "12", "--pipeline-model-parallel-size", "2", *extra])
    assert args.virtual_pipeline_model_parallel_size == size
    assert args.overlap_p2p_comm == (size is not None)  # overlapped sends only in the interleaved schedule
    config = transformer_config(args)
    assert config.virtual_pipeline_model_parallel_size == size and config.batch_p2p_comm == (size is None)


@pytest.mark.parametrize("global_batch, dp, group, rampup, problem", [
    (8, 1, None, None, None),  # 4 micro-batches, PP 2
    (4, 2, None, None, "1 micro-batches per step are fewer than --pipeline-model-parallel-size 2"),
    (6, 1, None, None, "3 micro-batches per step are not a multiple of --pipeline-model-parallel-size 2"),
    (8, 1, 3, None, "4 micro-batches per step leave a last group of 1"),  # fewer than PP 2
    (10, 1, 3, None, None),  # 5 = 3 + 2: the last group is as large as PP
    (4, 1, 3, None, "2 micro-batches per step are fewer than --microbatch-group-size-per-virtual-pipeline-stage 3"),
    (16, 1, None, [4, 2, 32], "3 micro-batches per step are not a multiple"),  # the ramp's 6
])
def test_interleaved_schedule_micro_batch_count_checked_at_start(global_batch, dp, group, rampup, problem):
    argv = [*BASE, "--num-layers", "12", "--pipeline-model-parallel-size", "2", "--micro-batch-size", "2",
            "--global-batch-size", str(global_batch), "--num-virtual-stages-per-pipeline-rank", "2"]
    argv += ["--microbatch-group-size-per-virtual-pipeline-stage", str(group)] if group else []
    argv += ["--rampup-batch-size", *map(str, rampup)] if rampup else []
    args = parse_args(argv)
    args.rank, args.data_parallel_size = 0, dp
    if problem is None:
        batch_schedule.init(args)
        return
    with pytest.raises(UserError) as exc:
        batch_schedule.init(args)
    message = str(exc.value)
    assert message.startswith("--global-batch-size ") and problem in message and "\n" not in message, message
    assert f"on each of {dp} data-parallel ranks" in message
