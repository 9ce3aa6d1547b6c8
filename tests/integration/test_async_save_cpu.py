"""--async-save with offload (2 CPU processes): the torch_dist files are written in the background,
and a checkpoint is proven complete (COMPLETE.json) and named by the tracker only in the finalize
step, once every rank's write has ended. A rank killed after a background write was scheduled
leaves that checkpoint unfinished: the restart ignores it, resumes from the previous one and
continues exactly as a run that never stopped (and never saved)."""

import pytest

from launch import run_pretrain
from megatron.training import checkpoint_integrity as integrity
from test_offload_cpu import offload_args

ITERS = 6
KILLED_AT_SAVE_4 = "save-scheduled@1#2"  # rank 1 dies just after scheduling the write of checkpoint 4


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("full")
    return run_pretrain(tmp, offload_args(tmp), train_iters=ITERS)


@pytest.fixture(scope="module")
def chain(tmp_path_factory):
    """A run killed after scheduling checkpoint 4's background write, then the same command again."""
    tmp = tmp_path_factory.mktemp("chain")
    ckpt = tmp / "ckpt"
    args = [*offload_args(tmp), "--save", str(ckpt), "--load", str(ckpt), "--save-interval", "2", "--async-save"]
    crashed = run_pretrain(tmp, args, train_iters=ITERS, env={"MLP_OFFLOAD_FAULT": KILLED_AT_SAVE_4},
                           loss_log=tmp / "crashed.jsonl", expect_success=False)[0]
    after_crash = {
        "tracker": (ckpt / integrity.TRACKER).read_text(),
        "states": {n: integrity.status(str(integrity.checkpoint_dir(ckpt, n))).state for n in (2, 4)},
    }
    resumed = run_pretrain(tmp, args, train_iters=ITERS, loss_log=tmp / "resumed.jsonl")
    return {"ckpt": ckpt, "crashed": crashed, "after_crash": after_crash, "resumed": resumed,
            "resumed_output": (tmp / "resumed.out").read_text()}


def test_a_kill_before_finalize_leaves_the_previous_checkpoint(chain):
    assert chain["crashed"]["returncode"] != 0, chain["crashed"]["output"][-3000:]
    assert "> saved checkpoint at iteration 2 " in chain["crashed"]["output"]  # finalized before the kill
    assert chain["after_crash"] == {"tracker": "2", "states": {2: integrity.COMPLETE_STATE, 4: integrity.INCOMPLETE}}
    output = chain["resumed_output"]
    assert f"removed incomplete checkpoint {chain['ckpt'] / 'iter_0000004'}" in output


def test_the_async_chain_resumes_exactly(chain, uninterrupted):
    resumed = chain["resumed"]
    assert [r["iteration"] for r in resumed] == list(range(3, ITERS + 1))
    assert resumed == uninterrupted[2:]


def test_every_save_is_finalized_before_exit(chain):
    """Each save says what it wrote synchronously and how long training was held, then, later, that
    it completed; the exit waited for the last one: all complete, the tracker at the last."""
    ckpt, output = chain["ckpt"], chain["resumed_output"]
    for n in (4, 6):
        assert f"> checkpoint at iteration {n}: offloaded optimizer state" in output
        assert "written synchronously, training held" in output
        assert f"> saved checkpoint at iteration {n} to {ckpt} (finalized in the background): " in output
    assert "not implemented" not in output
    assert (ckpt / integrity.TRACKER).read_text() == "6"
    assert {n: integrity.status(p).state for n, p in integrity.iteration_dirs(str(ckpt)).items()} == \
        {n: integrity.COMPLETE_STATE for n in (2, 4, 6)}
