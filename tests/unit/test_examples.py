"""The README's one-GPU and one-node recipes (examples/one_gpu.sh, examples/one_node.sh) as commands:
each script's DRY_RUN=1 output goes through pretrain_gpt.py's own parser (and, with PLAN=1, the
planner's), so a flag the parser no longer takes, or a layout that no longer divides the GPUs, fails
here. The SLURM recipe (examples/slurm/multi_node.sbatch) is run the same way, with stand-ins for srun
and torchrun, by tests/integration/test_slurm_scripts.py."""

import importlib.util
import os
import shlex
import subprocess
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from megatron.training.args.arguments import parse_args
from tests.profiles import examples

REPO = Path(__file__).resolve().parents[2]
LAUNCHER = ["python", "-m", "torch.distributed.run", "--standalone", "--nproc_per_node"]


def dry_run(script, *flags, **env):
    """The command the script would run: (the argv before pretrain_gpt.py's flags, those flags)."""
    environ = {k: v for k, v in os.environ.items()
               if k not in ("PLAN", "MOMENTS", "DATA_PATH", "NPROC", "TP", "PP", "HOST_GB", "DISK", "CKPT")}
    environ.update(DRY_RUN="1", **env)
    done = subprocess.run(["bash", str(REPO / "examples" / script), *flags], env=environ, cwd=REPO,
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    argv = shlex.split(done.stdout)
    split = argv.index("pretrain_gpt.py") + 1 if "pretrain_gpt.py" in argv else 2
    return argv[:split], argv[split:]


def test_one_gpu_recipe_is_a_command_pretrain_gpt_takes(tmp_path):
    launcher, flags = dry_run("one_gpu.sh", "--train-iters", "7", RUN_DIR=str(tmp_path))
    assert launcher == LAUNCHER + ["1", "pretrain_gpt.py"]
    args = parse_args(flags)
    assert args.train_iters == 7  # flags after the script name win
    assert args.offload_tiers == ["gpu", "host", "nvme"] and args.offload_gpu_cache_gb == "auto"
    assert args.offload_host_cache_gb == 74 and args.offload_paths == {"nvme": str(tmp_path / "nvme")}
    assert args.save == args.load == str(tmp_path / "ckpt") and args.mock_data
    assert (args.exp_avg_dtype, args.exp_avg_sq_dtype) == ("bf16", "bf16")
    assert (args.num_layers, args.hidden_size, args.ffn_hidden_size) == (36, 5120, 13824)  # the 10.24 B shape
    assert args.tensor_model_parallel_size == args.pipeline_model_parallel_size == 1


@settings(max_examples=examples(25))
@given(layout=st.sampled_from([(4, 2, 2), (8, 4, 2), (8, 2, 1), (2, 1, 2), (8, 8, 1)]),
       moments=st.sampled_from(["fp32", "bf16", "fp8"]), data=st.booleans())
def test_one_node_recipe_over_layouts_moments_and_data(layout, moments, data):
    nproc, tp, pp = layout
    env = dict(NPROC=str(nproc), TP=str(tp), PP=str(pp), MOMENTS=moments, RUN_DIR="/tmp/recipe")
    if data:
        env.update(DATA_PATH="/data/corpus_text_document",
                   TOKENIZER_ARGS="--tokenizer-type NullTokenizer --vocab-size 32000")
    launcher, flags = dry_run("one_node.sh", **env)
    assert launcher == LAUNCHER + [str(nproc), "pretrain_gpt.py"]
    args = parse_args(flags)
    assert (args.tensor_model_parallel_size, args.pipeline_model_parallel_size) == (tp, pp)
    assert nproc % (tp * pp) == 0
    assert args.offload_tiers == ["gpu", "host", "nvme"] and args.offload_host_cache_gb == 60
    stored = "fp32" if moments == "fp32" else moments
    assert (args.exp_avg_dtype, args.exp_avg_sq_dtype) == (stored, stored)
    assert args.use_precision_aware_optimizer == (moments != "fp32")
    assert args.mock_data != data and (args.data_path == ["/data/corpus_text_document"]) == data


def test_plan_mode_plans_the_same_flags():
    _, train = dry_run("one_node.sh", RUN_DIR="/tmp/recipe")
    planner_argv, plan = dry_run("one_node.sh", PLAN="1", GPU_GB="139", RUN_DIR="/tmp/recipe")
    assert planner_argv == ["python", "tools/plan_offload.py"]
    spec = importlib.util.spec_from_file_location("plan_offload_tool", REPO / "tools" / "plan_offload.py")
    tool = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tool)
    opts, capacities, flags = tool.parse(plan)
    assert (opts.gpus_per_node, opts.gpu_memory_gb) == (4, 139.0) and flags == train


@pytest.mark.parametrize("script", ["one_gpu.sh", "one_node.sh"])
def test_a_bad_setting_stops_in_one_line(script):
    done = subprocess.run(["bash", str(REPO / "examples" / script)], env=dict(os.environ, DRY_RUN="1", MOMENTS="int4"),
                          cwd=REPO, capture_output=True, text=True, timeout=60)
    assert done.returncode == 2 and done.stdout == ""
    assert done.stderr.strip() == "error: MOMENTS=int4: expected fp32, bf16 or fp8"
