"""Save and resume with the gpu tier in every mix, drawn: the resumed engine must continue as an
uninterrupted one, bit for bit, and the saving engine must not be disturbed by its save.

The gpu tier's subgroups leave device memory through a host copy of their own for checkpoints and
edits (state_access). On a CPU run the tier's stand-in is host memory, and that copy used to be
skipped there, so a reversed copy passed every CPU test while a resume on a GPU trained another
model (iteration 4 of a save at 2 differed). The copy is now chosen by tier, so these run it on the
CPU; on a CUDA machine (the GPU suite) the same cases run on the device as well."""

import dataclasses
import os
import tempfile

import pytest
import torch
from hypothesis import given, settings, strategies as st

from mlp_offload import ModelLink
from mlp_offload import OffloadConfig, OffloadedAdamW
from mlp_offload.checkpoint import load_engine_state
from mlp_offload.checkpoint.write import save_engine_state, start_background_save
from mlp_offload.subgroups.partition import partition
from tests.profiles import examples

from .helpers import BETAS, EPS, LR, WD, ModelParams, engine_state

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])
MIXES = (["gpu"], ["gpu", "host"], ["gpu", "nvme"], ["gpu", "host", "nvme"], ["host", "nvme"], ["host"])
STEPS = 4


@dataclasses.dataclass
class Case:
    numel: int
    subgroup_size: int
    remainders: bool
    moments: str
    save_tiers: list
    save_gpu_slots: int  # subgroups the gpu tier holds (where it is not the only tier)
    load_tiers: list
    load_gpu_slots: int
    saved_after: int
    update_on: str
    background: bool  # the save written by a background thread (--async-save's path)

    def config(self, root, name, tiers, gpu_slots, device) -> OffloadConfig:
        slot = partition(self.numel, self.subgroup_size)[0].state_bytes
        paths = {"nvme": f"{root}/{name}"} if "nvme" in tiers else {}
        only_gpu = tiers == ["gpu"]
        for d in paths.values():
            os.makedirs(d, exist_ok=True)
        return OffloadConfig(
            tiers=list(tiers), paths=paths, subgroup_size=self.subgroup_size, run_id=name, pin_memory=False,
            device=device, gpu_budget_bytes=(10**9 if only_gpu else gpu_slots * slot) if "gpu" in tiers else None,
            host_budget_bytes=3 * slot if "host" in tiers and paths else None,
            # every rate given: nothing is probed per engine (on CUDA the probes cost seconds each)
            bandwidths={t: (2e9, 1e9) for t in paths}, adam_kernel="single", adam_elems_per_s=1e9,
            device_adam_elems_per_s=1e9, device_streamed_elems_per_s=1e9, update_on=self.update_on, device_chunk_elems=3_000,
            param_remainders=self.remainders, state_dtypes=("fp32", self.moments, self.moments))


@st.composite
def cases(draw):
    numel = draw(st.integers(2_000, 40_000))
    subgroup_size = draw(st.integers(-(-numel // 8), numel))
    n = len(partition(numel, subgroup_size))
    save_tiers = list(draw(st.sampled_from(MIXES[:4])))  # the save holds some state in the gpu tier
    return Case(numel, subgroup_size, draw(st.booleans()), draw(st.sampled_from(["fp32", "bf16"])),
                save_tiers, draw(st.integers(1, n)), list(draw(st.sampled_from(MIXES))), draw(st.integers(1, n)),
                draw(st.integers(1, STEPS - 1)), draw(st.sampled_from(["cpu", "device", "auto"])),
                draw(st.booleans()))


def _engine(case, cfg, model):
    init = model.params.to("cpu", copy=True)
    return OffloadedAdamW(init.float() if not case.remainders else init, cfg, lr=LR, betas=BETAS, eps=EPS,
                          weight_decay=WD, numel=case.numel,
                          model=ModelLink(on_params_updated=model.on_params,
                                          param_high=model.source if case.remainders else None))


def _steps(eng, grads):
    for g in grads:
        eng.grad_buffer.copy_(g)
        eng.step()


def _state(eng, model):
    return [t.clone() for t in engine_state(eng)] + [model.params.to("cpu", copy=True)]


def _assert_same(want, got, what):
    for name, w, g in zip(("master", "exp_avg", "exp_avg_sq", "model params"), want, got):
        assert w.dtype == g.dtype and torch.equal(w.view(torch.uint8), g.view(torch.uint8)), f"{what}: {name} differs"


@pytest.mark.parametrize("device", DEVICES)
@settings(max_examples=examples(40), deadline=None, derandomize=True, print_blob=True)
@given(case=cases(), seed=st.integers(0, 3))
def test_a_resumed_engine_continues_as_the_uninterrupted_one(device, case, seed):
    """On the CPU every side runs one kernel, so the reference is a host-only engine and the resume may
    cross to another tier mix. On CUDA the device's subgroups take its own kernel (bit-identical to
    megatron-core's foreach AdamW, not to the CPU's single-tensor loop): there the reference is the
    saving set-up run without a save, and the resume keeps that set-up."""
    gen = torch.Generator().manual_seed(seed)
    init = torch.randn(case.numel, generator=gen).to(torch.bfloat16)
    grads = [(torch.randn(case.numel, generator=gen) * 10).to(torch.bfloat16) for _ in range(STEPS)]
    saving = (case.save_tiers, case.save_gpu_slots, device)
    reference = (["host"], 0, "cpu") if device == "cpu" else saving
    loading = (case.load_tiers, case.load_gpu_slots, device) if device == "cpu" else saving
    on = torch.device(device)  # the model's params live where the update runs (the kernel writes them there)
    with tempfile.TemporaryDirectory() as root:
        def run(name, setup, model, steps):
            with _engine(case, case.config(root, name, *setup), model) as eng:
                _steps(eng, steps)

        ref_model = ModelParams(init.to(reference[2], copy=True))
        with _engine(case, case.config(root, "ref", *reference), ref_model) as ref:
            _steps(ref, grads)
            want = _state(ref, ref_model)

        model = ModelParams(init.to(on, copy=True))
        path = f"{root}/state.offload"
        with _engine(case, case.config(root, "save", *saving), model) as eng:
            assert "gpu" in eng.placement.tier_of
            _steps(eng, grads[:case.saved_after])
            if case.background:
                write = start_background_save(eng, path)
                write.start()
                _steps(eng, grads[case.saved_after:])  # the update goes on beside the writer
                write.wait()
            else:
                save_engine_state(eng, path)
                _steps(eng, grads[case.saved_after:])
            _assert_same(want, _state(eng, model), "the engine that saved")

        # The model checkpoint of the save's step: the params as the reference had them then.
        mid_model = ModelParams(init.to(reference[2], copy=True))
        run("mid", reference, mid_model, grads[:case.saved_after])
        model = ModelParams(mid_model.params.to(on, copy=True))
        with _engine(case, case.config(root, "load", *loading), model) as eng:
            load_engine_state(eng, path)
            assert eng.steps_done == case.saved_after
            _steps(eng, grads[case.saved_after:])
            _assert_same(want, _state(eng, model), "the resumed engine")


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("tiers", [["gpu"], ["gpu", "host", "nvme"]])
def test_edits_of_the_state_reach_the_gpu_tier_and_nothing_else_changes(tmp_path, device, tiers):
    case = Case(30_000, 4_000, False, "fp32", tiers, 3, tiers, 3, 1, "cpu", False)
    model = ModelParams(torch.randn(case.numel).to(device=device, dtype=torch.bfloat16))
    with _engine(case, case.config(str(tmp_path), "e", tiers, 3, device), model) as eng:
        _steps(eng, [torch.randn(case.numel).to(torch.bfloat16)])
        before = _state(eng, model)
        eng.modify_state(lambda sg, p, m, v: None)  # reading alone must leave every tier as it was
        _assert_same(before, _state(eng, model), "after an edit that changes nothing")
        eng.modify_state(lambda sg, p, m, v: m.add_(1.0))
        after = engine_state(eng)
        assert torch.equal(after[1], before[1] + 1.0)
        assert torch.equal(after[0], before[0]) and torch.equal(after[2], before[2])
