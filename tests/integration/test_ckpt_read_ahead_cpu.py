"""The torch_dist files read ahead at a load (2 CPU processes on one node, the shared offloaded run's
checkpoint): a resume with the read-ahead (the default) goes on exactly as the run that saved it, and
its load line says the node read both ranks' torch_dist files whole. Launched through torchrun, which
sets the node rank (GROUP_RANK) the read-ahead groups ranks by."""

import re

from conftest import BASELINE_ITERS
from helpers import copy_checkpoint, offload_args
from launch import run_pretrain
from mlp_offload.checkpoint import human_bytes

SAVED_AT = 4


def test_a_resume_with_the_read_ahead_continues_bit_for_bit_and_says_so(tmp_path, offload_saved):
    ckpt = copy_checkpoint(offload_saved["ckpt"], [SAVED_AT], tmp_path / "ckpt")
    files = sorted((ckpt / f"iter_{SAVED_AT:07d}").glob("__*_*.distcp"))
    assert {f.name.split("_")[2] for f in files} == {"0", "1"}  # both ranks wrote some
    resumed = run_pretrain(tmp_path / "run", [*offload_args(tmp_path / "run"), "--load", str(ckpt)],
                           train_iters=BASELINE_ITERS, loss_log=tmp_path / "run" / "resumed.jsonl", torchrun=True)
    assert resumed == [r for r in offload_saved["losses"] if r["iteration"] > SAVED_AT]
    output = (tmp_path / "run" / "resumed.out").read_text()
    lines = re.findall(r"^> checkpoint read from .*$", output, re.M)
    assert len(lines) == 1, output[-3000:]
    said = re.search(r"; torch_dist files read ahead on this node: (.+) in [0-9.]+ s on \d threads \(whole\)$",
                     lines[0])
    assert said, lines[0]
    assert said.group(1) == human_bytes(sum(f.stat().st_size for f in files))
