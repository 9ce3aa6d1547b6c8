"""The load plan: what becomes of each kind of state, from the flags and a checkpoint's common state,
against a table written here (the optimizer's form, the scheduler, the resume position)."""

import argparse

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.profiles import examples

from megatron.training.checkpoint.load_plan import FROM_DISTRIBUTED, FROM_OFFLOADED, SAME_FORM, LoadPlan, plan_load
from megatron.training.errors import UserError


class _OffloadedOptimizer:
    """Has what OffloadedOptimizerCheckpoint asks for: the offload facade, as far as the plan can tell."""

    shards: list = []


def _expected_form(ckpt_offloaded, run_offloaded, wanted):
    if not wanted:
        return None
    return {(True, True): SAME_FORM, (False, False): SAME_FORM,
            (True, False): FROM_OFFLOADED, (False, True): FROM_DISTRIBUTED}[(ckpt_offloaded, run_offloaded)]


@settings(max_examples=examples(40), deadline=None, derandomize=True)
@given(ckpt_offloaded=st.booleans(), run_offloaded=st.booleans(), finetune=st.booleans(),
       no_load_optim=st.booleans(), iteration=st.integers(1, 10**6), consumed=st.integers(0, 10**9))
def test_each_kind_of_state_gets_what_the_flags_ask(ckpt_offloaded, run_offloaded, finetune, no_load_optim,
                                                    iteration, consumed):
    # A plain form that reshards by itself: no TP/PP layout to check against this (absent) run's.
    plain = {"param_state_sharding_type": "fully_reshardable"}
    common = {"iteration": iteration, "opt_param_scheduler": {"num_steps": 3},
              "optimizer": {"offload_meta": {}} if ckpt_offloaded else plain,
              "args": argparse.Namespace(consumed_train_samples=consumed)}
    args = argparse.Namespace(finetune=finetune, no_load_optim=no_load_optim, no_load_rng=True)
    optimizer = _OffloadedOptimizer() if run_offloaded else object()
    plan = LoadPlan.make(common, "/ckpt/iter_0000001", optimizer, args)
    wanted = not (finetune or no_load_optim)
    assert plan.optimizer == _expected_form(ckpt_offloaded, run_offloaded, wanted)
    assert plan.scheduler == wanted and plan.run_offloaded == run_offloaded and not plan.rng
    assert plan.reads_offload_files == (ckpt_offloaded and wanted)
    assert (plan.resume, plan.iteration, plan.consumed_samples) == (
        (False, 0, 0) if finetune else (True, iteration, consumed))
    assert plan.path == "/ckpt/iter_0000001" and plan.common is common
    assert any("weights only" in note for note in plan.notes) == (not wanted)


def test_a_checkpoint_without_optimizer_state_needs_the_weights_only_flags():
    common = {"iteration": 5, "args": argparse.Namespace(consumed_train_samples=40)}
    args = argparse.Namespace(finetune=False, no_load_optim=False, no_load_rng=True)
    with pytest.raises(UserError, match="holds no optimizer state .* pass --no-load-optim or --finetune"):
        LoadPlan.make(common, "/ckpt/iter_0000005", object(), args)
    args.no_load_optim = True
    plan = LoadPlan.make(common, "/ckpt/iter_0000005", object(), args)
    assert (plan.optimizer, plan.scheduler, plan.iteration, plan.consumed_samples) == (None, False, 5, 40)


def test_load_of_a_missing_directory_is_one_line(tmp_path):
    with pytest.raises(UserError, match=r"^--load .*nowhere: not a directory$"):
        plan_load(str(tmp_path / "nowhere"), object(), argparse.Namespace())
