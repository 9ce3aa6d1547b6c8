"""A resume opens each saved offload file at most twice (once for the footer and whatever the page cache
serves, once with O_DIRECT for the tensors, tiers.direct_io; the completeness proof lists its size but
leaves its checksums to the file itself) and parses its footer once, in every rank: at the saved layout
(DP2) and at another DP size (DP2 -> DP1).

The counts are of real opens: Python's ``open`` audit events in the loading ranks
(open_counting_pretrain.py), not calls into the checkpoint package."""

import json

import pytest

from conftest import copy_checkpoint
from launch import REPO, pretrain_command, pretrain_env, run_and_clean_up
from test_offload_cpu import offload_args

SAVED_AT = 2
COUNTING = REPO / "tests" / "integration" / "open_counting_pretrain.py"


def load_counting_opens(tmp, ckpt, nproc):
    """Load ``ckpt`` with ``nproc`` ranks and stop (no iteration); each rank's counts and the output."""
    tmp.mkdir(parents=True)
    counts = tmp / "counts"
    counts.mkdir()
    cmd = pretrain_command([*offload_args(tmp), "--load", str(ckpt)], nproc, SAVED_AT, tmp / "loss.jsonl",
                           warm=True, script=COUNTING)
    env = pretrain_env({"OPEN_COUNT_ROOT": str(ckpt), "OPEN_COUNT_DIR": str(counts)})
    code, output = run_and_clean_up(cmd, env, 240, tmp / "out.txt")
    assert code == 0, output[-4000:]
    return [json.loads((counts / f"rank{r}.json").read_text()) for r in range(nproc)], output


@pytest.mark.parametrize("nproc", [2, 1], ids=["same-layout", "dp2-to-dp1"])
def test_each_saved_file_is_opened_at_most_twice_and_its_footer_read_once(tmp_path, offload_saved, nproc):
    ckpt = copy_checkpoint(offload_saved["ckpt"], [SAVED_AT], tmp_path / "ckpt")
    saved = sorted(p.name for p in (ckpt / f"iter_{SAVED_AT:07d}" / "offload").glob("*.offload"))
    assert saved == ["pp000_tp000_dp000.offload", "pp000_tp000_dp001.offload"]
    ranks, output = load_counting_opens(tmp_path / "run", ckpt, nproc)
    assert ("offloaded state resharded from data-parallel size 2 to 1" in output) == (nproc == 1), output[-3000:]
    for rank, counts in enumerate(ranks):
        print(f"rank {rank}: opens {counts['opens']}, footers read {counts['footers']}")
        assert counts["opens"], "the load opened no offload file: nothing was counted"
        assert all(n <= 2 for n in counts["opens"].values()), (rank, counts)
        assert all(n == 1 for n in counts["footers"].values()), (rank, counts)
