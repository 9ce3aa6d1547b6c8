"""A flag that needs a missing optional package fails at start-up in one line naming the package."""

import subprocess
import sys
from pathlib import Path

import pytest

from megatron.training.runtime import optional_packages
from megatron.training.args.arguments import parse_args
from megatron.training.errors import UserError

REPO = Path(__file__).resolve().parents[2]
MODEL = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "64",
         "--micro-batch-size", "1", "--mock-data", "--train-iters", "1", "--lr", "1e-3"]


@pytest.mark.parametrize("flags, package", [
    (["--wandb-project", "p", "--wandb-exp-name", "e", "--wandb-save-dir", "w"], "wandb"),
    (["--tensorboard-dir", "tb"], "tensorboard"),
    (["--tokenizer-type", "TikTokenizer", "--tokenizer-model", "t.tiktoken", "--vocab-size", "100"], "tiktoken"),
    (["--tokenizer-type", "Llama2Tokenizer", "--tokenizer-model", "t.model"], "sentencepiece"),
])
def test_flag_needing_a_missing_package_is_one_line(monkeypatch, flags, package):
    monkeypatch.setattr(optional_packages, "missing", lambda module: module == package)
    with pytest.raises(UserError) as err:
        parse_args([*MODEL, *flags])
    line = str(err.value)
    assert "\n" not in line and line.startswith(flags[0]) and f"needs the {package} package" in line
    assert optional_packages.REQUIREMENT[package] in line


def test_present_packages_pass():
    args = parse_args([*MODEL, "--tensorboard-dir", "tb"])  # installed here: no error, the flag kept
    assert args.tensorboard_dir == "tb"


def test_plotting_without_matplotlib_is_one_line(tmp_path):
    code = ("import sys, runpy; sys.modules['matplotlib'] = None; "  # None in sys.modules: import fails
            f"sys.argv = ['plot_timeline.py', 'a.json', 'b.png']; runpy.run_path('{REPO}/tools/plot_timeline.py')")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert done.returncode == 1 and "Traceback" not in done.stderr
    assert done.stderr.strip().splitlines() == [done.stderr.strip()] and "needs the matplotlib package" in done.stderr
