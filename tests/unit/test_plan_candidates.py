"""The planner's recommendation (tools/plan_offload.py --recommend, offload/plan_candidates.py): every
candidate planned as if the user had given its flags, the fastest that fits chosen, and a plan that does
not fit the GPU naming flags that do."""

import contextlib
import io
import json

import pytest
from hypothesis import given, settings, strategies as st

from megatron.training.offload.plan_candidates import IN_HOST, RECOMPUTE, layouts, recompute_work, without
from tests.profiles import examples

from .test_plan_replay import FOUR_H200, H200_TFLOPS, LLAMA, LLAMA_13B_TP2PP2, RUNS, plan, planner

RUN_20B = RUNS["20.68B bf16 moments, one H200"].flags
NO_RECOMPUTE_20B = RUN_20B.replace("--recompute-granularity full --recompute-method uniform --recompute-num-layers 1",
                                   "")


@pytest.fixture(scope="module")
def tool():
    return planner()


def run(tool, flags: str):
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        code = tool.main(["--json", "--convert-gelems", "1000", *flags.split()])
    return code, json.loads(out.getvalue())


names = st.sampled_from(["--a", "--b", "--c", "--flag"])


@settings(max_examples=examples(100))
@given(items=st.lists(st.tuples(names, st.booleans(), st.integers(0, 9)), max_size=8),
       removed=st.sets(names))
def test_without_drops_each_named_flag_and_its_value_in_either_form(items, removed):
    """Flags built here as (name, '=' form?, value): the kept ones come back in order, whole."""
    flags, kept = [], []
    for name, joined, value in items:
        given_as = [f"{name}={value}"] if joined else [name, str(value)]
        flags += given_as
        if name not in removed:
            kept += given_as
    assert without(flags, {name: 1 for name in removed}) == kept


def test_recompute_work_counts_forward_passes():
    """Backward = 2 forwards: full recompute does 4 of 3; block recompute of n of L layers 3 + n/L."""
    assert recompute_work("full", "uniform", 1, 52) == pytest.approx(4 / 3)
    assert recompute_work("full", "block", 13, 52) == pytest.approx((3 + 13 / 52) / 3)
    assert recompute_work("selective") == recompute_work(None) == 1.0


def test_every_candidate_is_planned_as_its_own_flags_and_the_fastest_fitting_is_chosen(tool):
    code, got = run(tool, f"--recommend --gpu-tflops {H200_TFLOPS} {RUN_20B}")
    advice = got["recommendation"]
    rows = advice["candidates"]
    # Global batch 1 on one GPU: micro-batch 1 only; three recompute settings x gpu tier auto or none, and with
    # full recompute each of IN_HOST's sets (the params resident, or in host memory with what else goes there).
    assert len(rows) == (len(RECOMPUTE) - 1 + len(IN_HOST)) * 2
    fitting = [r for r in rows if r["fits"]]
    fastest = max(r["tokens_per_s"] for r in fitting)
    assert advice["chosen"]["tokens_per_s"] == fastest  # ties: the fewest flags changed
    assert advice["chosen"]["changed"] == min(r["changed"] for r in fitting if r["tokens_per_s"] == fastest)
    base = without(NO_RECOMPUTE_20B.split(), {"--offload-gpu-cache-gb": 1})  # later flags replace earlier ones
    for row in fitting:  # each row is the plan of its own flags (at its recompute's scaled TFLOP/s)
        recompute = row["candidate"].split(",")[0].split()[1]
        tflops = H200_TFLOPS * (4 / 3) / recompute_work(recompute)  # the replay's TFLOP/s was measured with full
        # (the row names its TFLOP/s: an experiment plans the chosen flags again at it, beside the run)
        assert row["gpu_tflops"] == pytest.approx(tflops, rel=1e-12)
        alone = plan(tool, " ".join(base + row["changes"]), tflops=tflops)
        assert alone["tokens_per_s"]["1"] == pytest.approx(row["tokens_per_s"], rel=1e-9)
    # The run as recorded is among the candidates, with the figures of the plain plan.
    as_run = next(r for r in rows if r["candidate"] == "recompute full, micro-batch 1, gpu tier auto")
    assert as_run["tokens_per_s"] == pytest.approx(got["tokens_per_s"]["1"], rel=1e-9)
    assert advice["chosen"]["tokens_per_s"] >= as_run["tokens_per_s"]


def test_a_run_that_overflows_the_gpu_names_flags_that_fit(tool):
    """Without recompute the 20.68 B run's activations overflow the H200: DOES NOT FIT names the flags of
    the fastest candidate that fits, and the plan of those flags fits."""
    code, got = run(tool, NO_RECOMPUTE_20B)
    assert code == 1 and not got["fits"]
    hint = next(p for p in got["problems"] if p.startswith("fits with "))
    changes = hint[len("fits with "):].split(":")[0]
    assert "--recompute-granularity" in changes
    code, fixed = run(tool, f"{NO_RECOMPUTE_20B} {changes}")
    assert code == 0 and fixed["fits"], fixed["problems"]


@settings(max_examples=examples(100))
@given(nodes=st.integers(1, 3), per_node=st.integers(1, 8), num_layers=st.integers(1, 24))
def test_layouts_are_every_tp_within_a_node_and_pp_dividing_the_layers(nodes, per_node, num_layers):
    """Against a brute-force walk of every TP x PP pair the world could take."""
    world = nodes * per_node
    expected = {(t, p) for t in range(1, world + 1) for p in range(1, world + 1)
                if world % (t * p) == 0 and per_node % t == 0 and num_layers % p == 0}
    got = layouts(world, per_node, num_layers)
    assert len(got) == len(set(got)) and set(got) == expected


def test_layout_candidates_are_planned_as_their_own_flags(tool):
    """--layouts 4x1,2x2: each layout's candidates are the plans of their own flags (TP and PP replaced),
    at the global batch size given; the chosen one is the fastest that fits."""
    flags = (f"{FOUR_H200} --adam-gelems 4.62 {LLAMA} {LLAMA_13B_TP2PP2} --offload-tiers gpu,host "
             "--offload-gpu-cache-gb auto --gpu-tflops 216.7").replace("--global-batch-size 8", "--global-batch-size 2")
    code, got = run(tool, f"--recommend --layouts 4x1,2x2 {flags}")
    rows = got["recommendation"]["candidates"]
    # Data-parallel size 1 at both layouts: micro-batch 1 or 2, three recompute settings (full once per IN_HOST
    # set, and each layer-major set also in passes of one micro-batch where the step has two), gpu tier auto or none.
    layer_major_sets = len(IN_HOST) - 1
    per_tier = (len(RECOMPUTE) - 1 + len(IN_HOST) + layer_major_sets) + (len(RECOMPUTE) - 1 + len(IN_HOST))
    assert len(rows) == 2 * 2 * per_tier
    assert sum("in passes of 1 micro-batch" in r["candidate"] for r in rows) == 2 * 2 * layer_major_sets
    assert {r["candidate"].split(",")[0] for r in rows} == {"TP 4 x PP 1", "TP 2 x PP 2"}
    fitting = [r for r in rows if r["fits"]]
    assert got["recommendation"]["chosen"]["tokens_per_s"] == max(r["tokens_per_s"] for r in fitting)
    for layout in ("TP 4 x PP 1", "TP 2 x PP 2"):
        row = next(r for r in fitting if r["candidate"].startswith(layout) and "recompute full" in r["candidate"])
        alone = plan(tool, " ".join(flags.split() + row["changes"]), tflops=216.7)
        assert alone["tokens_per_s"]["2"] == pytest.approx(row["tokens_per_s"], rel=1e-9)


@pytest.mark.parametrize("bad", ["4", "2x0", "ax1", "2x2x1"])
def test_bad_layouts_get_one_line(tool, bad, capsys):
    flags = f"{FOUR_H200} {LLAMA} {LLAMA_13B_TP2PP2} --offload-tiers gpu,host --offload-gpu-cache-gb auto"
    with pytest.raises(SystemExit):
        run(tool, f"--recommend --layouts {bad} {flags}")
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--layouts" in err[0] and repr(bad) in err[0]


def test_the_default_tflops_follows_the_flags_recompute(tool):
    """The default TFLOP/s figures were measured with full recompute (the FLOPs counted without it): the
    same run planned with selective recompute and no --gpu-tflops computes at 4/3 of the figure, and
    --recommend plans every candidate alike whichever recompute the flags came with."""
    selective = NO_RECOMPUTE_20B + " --recompute-granularity selective"
    _, full = run(tool, RUN_20B)
    _, sel = run(tool, selective)
    assert sel["predicted_compute_s"] == pytest.approx(full["predicted_compute_s"] * 3 / 4, rel=1e-9)
    _, a = run(tool, f"--recommend {RUN_20B}")
    _, b = run(tool, f"--recommend {selective}")
    rows_a = {r["candidate"]: r.get("tokens_per_s") for r in a["recommendation"]["candidates"]}
    rows_b = {r["candidate"]: r.get("tokens_per_s") for r in b["recommendation"]["candidates"]}
    assert rows_a.keys() == rows_b.keys()
    for name, tokens in rows_a.items():
        assert (tokens is None) == (rows_b[name] is None)
        if tokens is not None:
            assert rows_b[name] == pytest.approx(tokens, rel=1e-9), name
