"""The resume check across a real save and load (2 CPU processes, the shared offloaded run's
checkpoint: host, nvme and pfs tiers): an untouched load says in one line that every rank's params
and optimizer state match their save; state broken on purpose after the load (a model param, an
Adam step) or in an offload file (one byte of a moment, its CRC made right) stops the run with one
error line naming each rank and tensor, unless --no-resume-check. The loads stop at the saved
iteration: no training step."""

import re

from helpers import copy_checkpoint, offload_args
from launch import REPO, pretrain_command, pretrain_env, run_and_clean_up
from megatron.training.checkpoint import integrity
from mlp_offload.checkpoint import read_footer, state_file_bytes, stored_codecs
from tests.unit.test_state_digest import flip_stored_byte

SAVED_AT = 4
BREAKING = REPO / "tests" / "integration" / "resume_check_pretrain.py"


def load(tmp, ckpt, env=None, extra=(), nproc=2):
    """Load ``ckpt`` with ``nproc`` ranks and stop: (exit status, output)."""
    cmd = pretrain_command([*offload_args(tmp), "--load", str(ckpt), *extra], nproc, SAVED_AT, tmp / "loss.jsonl",
                           warm=True, script=BREAKING)
    return run_and_clean_up(cmd, pretrain_env({"RESUME_CHECK_BREAK": "none@-1", **(env or {})}), 240,
                            tmp / f"out{len(list(tmp.glob('out*.txt')))}.txt")


def resign(path):
    """The checkpoint's proof written again over what it holds now, as a save that wrote those bytes would."""
    (path / integrity.COMPLETE).unlink()
    integrity.mark_in_progress(str(path))
    integrity.mark_complete(str(path), SAVED_AT)


def offload_files(ckpt):
    return sorted((ckpt / f"iter_{SAVED_AT:07d}" / "offload").glob("*.offload"))


def test_an_untouched_resume_matches_its_save_in_one_line(tmp_path, offload_saved):
    ckpt = copy_checkpoint(offload_saved["ckpt"], [SAVED_AT], tmp_path / "ckpt")
    code, output = load(tmp_path, ckpt)
    assert code == 0, output[-4000:]
    lines = re.findall(r"^> resume check: .*$", output, re.M)
    assert len(lines) == 1, output[-4000:]
    found = re.fullmatch(rf"> resume check: params and optimizer state of 2 ranks match their save at iteration "
                         rf"{SAVED_AT} \(digest of ([0-9.]+) MB\)", lines[0])
    assert found, lines
    # What was digested: both ranks' offloaded state (each file's tensors, in it or in its part files) and
    # their bf16 params.
    state = sum(state_file_bytes(e["end"] - e["start"], stored_codecs(footer), e.get("blocks"))
                for footer in map(read_footer, map(str, offload_files(ckpt))) for e in footer["subgroups"])
    params = int(re.search(r"> model parameters \(all stages, one replica\): (\d+)", output).group(1))
    assert abs(float(found.group(1)) - (state + 2 * 2 * params) / 1e6) <= 0.005


def break_a_moment(ckpt, dp: int, tensor: int) -> str:
    """One byte of element 2 of subgroup 1's ``tensor`` in rank ``dp``'s offload file, its CRC and the
    checkpoint's proof made right again; returns the name of the parameter it belongs to, as the model
    names it."""
    path = str(offload_files(ckpt)[dp])
    footer = read_footer(path)
    flip_stored_byte(path, 1, tensor, 9)  # fp32: byte 9 is element 2's
    element = footer["subgroups"][1]["start"] + 2
    owner = next(name for name, _, length, flat in footer["metadata"]["params"] if flat <= element < flat + length)
    resign(ckpt / f"iter_{SAVED_AT:07d}")
    return re.sub(r"^(module\.)+", "", owner.partition(".")[2])  # no wrappers, no chunk 0


def test_state_broken_on_purpose_is_named_by_rank_and_tensor(tmp_path, offload_saved):
    ckpt = copy_checkpoint(offload_saved["ckpt"], [SAVED_AT], tmp_path / "ckpt")
    shown = break_a_moment(ckpt, 0, 2)
    code, output = load(tmp_path, ckpt, {"RESUME_CHECK_BREAK": "step@0,param@1"})
    assert code != 0
    errors = [line for line in output.splitlines() if "error: resume check:" in line]
    assert len(errors) == 1, output[-4000:]
    assert re.search(rf"rank 0, the Adam step count of its dense optimizer state is {SAVED_AT - 1}, its save at "
                     rf"iteration {SAVED_AT} recorded {SAVED_AT}; rank 0, tensor {re.escape(shown)} exp_avg_sq differs "
                     rf"from its save at iteration {SAVED_AT} \(digest [0-9a-f:]+ vs [0-9a-f:]+\); rank 1, model param "
                     rf"embedding\.word_embeddings\.weight differs from its save", errors[0]), errors[0]
    assert "Traceback" not in output
    # --no-resume-check: the same load goes on, and says nothing of a check.
    code, output = load(tmp_path, ckpt, {"RESUME_CHECK_BREAK": "step@0,param@1"}, ["--no-resume-check"])
    assert code == 0, output[-4000:]
    assert "resume check" not in output


def test_a_load_at_another_data_parallel_size_compares_each_parameter_over_its_ranks(tmp_path, offload_saved):
    """DP 2 -> 1: the one rank's params against a saved rank's, its optimizer state per parameter
    against both saved ranks' pieces together; a moment broken in the second rank's file is found."""
    ckpt = copy_checkpoint(offload_saved["ckpt"], [SAVED_AT], tmp_path / "ckpt")
    code, output = load(tmp_path, ckpt, nproc=1)
    assert code == 0, output[-4000:]
    assert re.search(rf"^> resume check: params and optimizer state of 1 rank match their save at iteration "
                     rf"{SAVED_AT} \(the optimizer state per parameter over each position's data-parallel ranks\) "
                     rf"\(digest of [0-9.]+ MB\)$", output, re.M), output[-4000:]
    shown = break_a_moment(ckpt, 1, 1)
    code, output = load(tmp_path, ckpt, nproc=1)
    errors = [line for line in output.splitlines() if "error: resume check:" in line]
    assert code != 0 and len(errors) == 1, output[-4000:]
    assert f"rank 0, tensor {shown} exp_avg (its data-parallel ranks' pieces together) differs" in errors[0], errors
