"""The index of a checkpoint's offload files (offloaded_state): a parameter split over the files of
several DP ranks reads back as the tensor that was split (the reference: torch.cat of the pieces),
each file is opened once however many reads, and a set that disagrees is refused in one line."""

import builtins

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.profiles import examples

from megatron.training.checkpoint.offload_files import offload_file_path
from megatron.training.checkpoint.offloaded_state import SavedOffloadState
from mlp_offload import OffloadedAdamW
from mlp_offload.checkpoint import CheckpointDataError
from mlp_offload.checkpoint.write import save_engine_state

from .helpers import fast_config

NUMEL = 900  # one parameter "0.w", split over the files at the cuts drawn


def _save_split(tmp_path, full, cuts, steps=(3,)):
    """The three tensors ``full`` split at ``cuts``, one DP rank's file per piece (steps: each file's count)."""
    bounds = [0, *cuts, NUMEL]
    for dp, (a, b) in enumerate(zip(bounds, bounds[1:])):
        with OffloadedAdamW(torch.zeros(b - a), fast_config(tmp_path / f"e{dp}", tiers=["host"])) as eng:
            def fill(sg, *outs):
                for out, whole in zip(outs, full):
                    out.copy_(whole[a + sg.start: a + sg.end])

            eng.load_state(fill, steps_done=steps[dp % len(steps)])
            meta = {"dp_size": len(bounds) - 1, "params": [["0.w", a, b - a, 0]], "geometry": {},
                    "model_chunks": 1, "ep_size": 1}
            path = offload_file_path(str(tmp_path / "iter"), 0, 0, dp)
            (tmp_path / "iter" / "offload").mkdir(parents=True, exist_ok=True)
            save_engine_state(eng, path, meta)


@settings(max_examples=examples(20), deadline=None)
@given(cuts=st.lists(st.integers(1, NUMEL - 1), min_size=1, max_size=3, unique=True).map(sorted),
       start=st.integers(0, NUMEL - 1), length=st.integers(1, NUMEL))
def test_a_parameter_split_over_dp_files_reads_back_and_each_file_opens_once(tmp_path_factory, cuts, start, length):
    tmp_path = tmp_path_factory.mktemp("split")
    full = [torch.randn(NUMEL, generator=torch.Generator().manual_seed(k)) for k in range(3)]
    _save_split(tmp_path, full, cuts)
    end = min(NUMEL, start + length)
    opened = []
    real_open = builtins.open

    def counting_open(path, *args, **kwargs):
        opened.append(str(path))
        return real_open(path, *args, **kwargs)

    builtins.open = counting_open
    try:
        with SavedOffloadState(str(tmp_path / "iter"), steps_done=3) as saved:
            position = saved.position("dense", 0, 0)
            for _ in range(2):  # a second read goes to the files already open
                outs = [torch.empty(end - start) for _ in range(3)]
                position.read_by_name("0.w", start, end, outs)
                for out, whole in zip(outs, full):
                    assert torch.equal(out, whole[start:end])
    finally:
        builtins.open = real_open
    assert sorted(opened) == sorted(set(opened)) and len(opened) == len(cuts) + 1


def test_a_missing_file_or_another_step_count_is_one_line(tmp_path):
    full = [torch.zeros(NUMEL) for _ in range(3)]
    _save_split(tmp_path, full, [300, 600], steps=(3, 3, 4))
    with SavedOffloadState(str(tmp_path / "iter"), steps_done=3) as saved:
        with pytest.raises(CheckpointDataError, match=r"dp002.offload: its offloaded state is at step 4, the "
                                                      r"checkpoint's metadata says 3$"):
            saved.position("dense", 0, 0)
    (tmp_path / "iter" / "offload" / "pp000_tp000_dp002.offload").unlink()
    with SavedOffloadState(str(tmp_path / "iter")) as saved:
        with pytest.raises(CheckpointDataError, match="found 2 offload files for pp=0 tp=0, their data-parallel "
                                                      "size says 3: the checkpoint is incomplete"):
            saved.position("dense", 0, 0)
