"""tools/plan_offload.py: its numbers against a hand calculation and against a real CPU run of the
same flags (parameters, the engine's placement, the bytes each step moves per tier). The numbers
come from the tool's main() in this process (no interpreter start-up per plan); its command line,
exit status and error lines from a process of its own."""

import contextlib
import io
import json
import re
import subprocess
import sys

import pytest

from helpers import PLANNER, offload_args, plan_json, planner
from launch import REPO, TINY_MODEL, pretrain_env, read_loss_log, run_pretrain

ITERS = 5


def plan(*flags, expect=0):
    done = subprocess.run([sys.executable, str(PLANNER), *flags], cwd=REPO, env=pretrain_env(),
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == expect, done.stdout + done.stderr
    return done


def test_json_from_the_command_line():
    """The command line gives what main() gives, and its exit status says whether the plan fits."""
    flags = ["--gpus-per-node", "1", "--gpu-memory-gb", "1", "--gpu-tflops", "100", *TINY_MODEL]
    assert json.loads(plan("--json", *flags, expect=1).stdout) == plan_json(*flags, expect=1)


@pytest.fixture(scope="module")
def real_run(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("planned")
    flags = offload_args(tmp, tiers=("host", "nvme")) + ["--tensor-model-parallel-size", "2"]
    run_pretrain(tmp, flags + ["--offload-telemetry-log", str(tmp / "telemetry.jsonl")], train_iters=ITERS)
    output = next(tmp.glob("*.out")).read_text()
    return flags, output, read_loss_log(tmp / "telemetry.jsonl")


def test_the_plan_is_what_the_engine_did(real_run):
    flags, output, steps = real_run
    got = plan_json("--gpus-per-node", "2", "--host-memory-gb", "8", "--adam-gelems", "0.1", "--convert-gelems", "1",
                    "--offload-nvme-capacity-gb", "1", *TINY_MODEL, *flags)
    assert got["fits"] and got["problems"] == []
    params = int(re.search(r"model parameters \(all stages, one replica\): (\d+)", output).group(1))
    assert got["params_total"] == params
    engine = re.search(r"offload rank 0: (\d+) params in (\d+) subgroups; placement (\{[^}]*\})", output)
    shard = int(engine.group(1))
    # The engine's shard is megatron-core's bucket, padded for the data-parallel split.
    assert got["optimizer_state_elements_per_rank"] <= shard < got["optimizer_state_elements_per_rank"] * 1.01 + 256
    assert got["subgroups"] == int(engine.group(2))
    assert got["placement"] == json.loads(engine.group(3).replace("'", '"'))
    # Steady state: the two order directions alternate, so steps 2..5 move two of each. Each step's
    # record counts what completed since the last one, so one subgroup may land a step late.
    subgroup_state = 3 * 24576  # three fp32 regions of 6000 elements, 24000 bytes each aligned to 4096
    for kind in ("read", "write"):
        moved = sum(s["tiers"]["nvme"][f"{kind}_bytes"] for s in steps[1:])
        planned = got["io_bytes_per_rank_per_step"]["nvme"][kind] * (ITERS - 1)
        assert abs(moved - planned) <= subgroup_state, (kind, moved, planned)


def test_numbers_against_a_hand_calculation():
    """No offload, one GPU, a model small enough to count by hand."""
    flags = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "32",
             "--max-position-embeddings", "32", "--vocab-size", "384", "--micro-batch-size", "2",
             "--global-batch-size", "4", "--bf16", "--use-distributed-optimizer", "--device", "cpu"]
    got = plan_json("--gpus-per-node", "1", "--gpu-memory-gb", "1", "--gpu-tflops", "100", *flags, expect=1)
    h, v, s, layers = 64, 384, 32, 2
    per_layer = 2 * (2 * h) + (3 * h * h + 3 * h) + (h * h + h) + (4 * h * h + 4 * h) + (4 * h * h + h)
    params = v * h + s * h + layers * per_layer + 2 * h  # tied output layer, learned positions, final norm
    assert got["params_total"] == params
    gpu = got["gpu_bytes_per_rank"]
    assert gpu["parameters"] == 2 * params and gpu["gradients"] == 4 * params
    assert gpu["optimizer_state"] == 12 * params  # fp32 master weights and two moments, one rank
    # FLOPs as Megatron-LM counts them: per token and layer 2*(qkv 3h^2 + scores and weighting 2*s*h halved
    # by the causal mask + proj h^2 + mlp 8h^2), logits 2*h*v; backward twice the forward; 4 sequences of 32.
    forward = layers * 2 * (3 * h * h + s * h + h * h + 8 * h * h) + 2 * h * v
    # rel=1e-9 here and below: the planner sums the same terms in its own order (float rounding only)
    assert got["predicted_compute_s"] == pytest.approx(3 * forward * s * 4 / 100e12, rel=1e-9)
    assert got["predicted_iteration_s"] == pytest.approx(got["predicted_compute_s"], rel=1e-9)
    assert got["fits"] is False and "GPU memory" in got["problems"][0]  # the 2 GiB CUDA reserve alone


def test_interleaved_pipeline_holds_more_activations_and_a_shorter_bubble():
    """PP=2 with 4 micro-batches: 1F1B holds 2 in flight and idles (PP-1)/M; two chunks per rank hold
    ceil((1 + 1/4) * 2) = 3 and idle half as long (Megatron-LM's memory estimate, Narayanan et al.)."""
    flags = ["--gpus-per-node", "2", "--gpu-tflops", "100", "--num-layers", "8", "--hidden-size", "64",
             "--num-attention-heads", "4", "--seq-length", "32", "--micro-batch-size", "2", "--global-batch-size", "8",
             "--bf16", "--use-distributed-optimizer", "--device", "cpu", "--pipeline-model-parallel-size", "2"]
    plain, interleaved = plan_json(*flags), plan_json(*flags, "--num-layers-per-virtual-pipeline-stage", "2")
    activations = [p["gpu_bytes_per_rank"]["activations"] for p in (plain, interleaved)]
    # approx: the planner's figures are floats summed in its own order; the ratios here are exact fractions
    assert activations[1] == pytest.approx(activations[0] * 3 / 2, rel=1e-6)
    assert interleaved["predicted_compute_s"] == pytest.approx(plain["predicted_compute_s"] * (1 + 1 / 8) / (1 + 1 / 4))
    assert interleaved["params_per_rank"] == plain["params_per_rank"]  # the same layers per rank, in two chunks


def test_precision_aware_state_is_planned_smaller(tmp_path):
    """bf16 moments: 8 bytes per parameter instead of 12 (each region page-aligned), in every tier."""
    flags = [*TINY_MODEL, *offload_args(tmp_path, tiers=("host", "nvme"))]
    machine = ["--gpus-per-node", "2", "--adam-gelems", "1", "--convert-gelems", "1", "--offload-nvme-capacity-gb", "1"]
    fp32 = plan_json(*machine, *flags)
    bf16 = plan_json(*machine, *flags, "--use-precision-aware-optimizer", "--exp-avg-dtype", "bf16",
                     "--exp-avg-sq-dtype", "bf16")
    n = fp32["optimizer_state_elements_per_rank"]
    sizes = [6000] * (n // 6000) + ([n % 6000] if n % 6000 else [])  # --offload-subgroup-size 6000
    assert fp32["subgroups"] == len(sizes)

    def region(numel, itemsize):  # each of a subgroup's three regions is padded to a 4096-byte page
        return -(-numel * itemsize // 4096) * 4096

    assert fp32["optimizer_state_bytes_per_rank"] == sum(3 * region(k, 4) for k in sizes)
    assert bf16["optimizer_state_bytes_per_rank"] == sum(region(k, 4) + 2 * region(k, 2) for k in sizes)
    assert sum(bf16["tier_bytes_per_node"].values()) < sum(fp32["tier_bytes_per_node"].values())


def test_a_disk_too_small_does_not_fit(tmp_path):
    flags = offload_args(tmp_path, tiers=("host", "nvme"))
    got = plan_json("--gpus-per-node", "2", "--adam-gelems", "1", "--convert-gelems", "1",
                    "--offload-nvme-capacity-gb", "0.0001", *TINY_MODEL, *flags, expect=1)
    assert not got["fits"] and re.search(r"not enough disk space .* --offload-host-cache-gb", got["problems"][0])


@pytest.mark.parametrize("extra, message", [
    (["--gpus-per-node", "3", "--tensor-model-parallel-size", "2"],
     r"^error: --nnodes 1 x --gpus-per-node 3 = 3 GPUs is not a multiple of TP 2 x PP 1$"),
    (["--offload-tiers", "host,nvme", "--offload-nvme-path", "/nonexistent/nvme", "--offload-host-cache-gb", "1",
      "--offload-bandwidths", "nvme=2:1"],
     r"^error: --offload-nvme-capacity-gb: needed to plan tier 'nvme' \(its path /nonexistent/nvme is not here\)$"),
    (["--offload-tiers", "host", "--offload-pfs-capacity-gb", "3"],
     r"^error: argument --offload-pfs-capacity-gb: 'pfs' is not one of --offload-tiers host$"),
])
def test_bad_input_is_one_line(extra, message):
    err = io.StringIO()
    with contextlib.redirect_stderr(err), pytest.raises(SystemExit) as exited:
        planner().main([*TINY_MODEL, *extra])
    stderr = err.getvalue()
    lines = [line for line in stderr.splitlines() if line.startswith("error:")]
    assert exited.value.code == 2 and len(lines) == 1 and re.match(message, lines[0]), stderr
    assert "Traceback" not in stderr, stderr


def test_host_memory_the_guard_would_refuse_does_not_fit(tmp_path):
    """The planner counts every host consumer (cache, staging, the processes, their data workers)
    and runs the start-up guard's own check against the node's memory."""
    flags = offload_args(tmp_path, tiers=("host", "nvme"))
    got = plan_json("--gpus-per-node", "2", "--adam-gelems", "1", "--convert-gelems", "1", "--host-memory-gb", "0.5",
                    "--offload-nvme-capacity-gb", "1", *TINY_MODEL, *flags, "--num-workers", "2", expect=1)
    host = got["host_bytes_per_node"]
    assert host["data_workers"] > 0 and host["process"] > 0 and sum(host.values()) > 0.5 * 2**30
    assert not got["fits"] and any(re.search(r"more than the 0.50 GiB of the node's memory; .*--offload-host-cache-gb",
                                             p) for p in got["problems"]), got["problems"]


MOE_PLAN = ["--num-layers", "4", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "32",
            "--max-position-embeddings", "32", "--vocab-size", "384", "--micro-batch-size", "2",
            "--global-batch-size", "4", "--bf16", "--use-distributed-optimizer", "--device", "cpu",
            "--num-experts", "4", "--moe-router-topk", "2", "--swiglu", "--disable-bias-linear",
            "--normalization", "RMSNorm", "--position-embedding-type", "rope", "--moe-layer-freq", "([0]+[1])*2",
            "--expert-model-parallel-size", "2", "--moe-token-dispatcher-type", "alltoall"]


def test_moe_numbers_against_a_hand_calculation(tmp_path):
    """DP 2 x EP 2 on two GPUs, dense and MoE layers alternating: parameters (total and active per
    token), each optimizer's shard (dense over DP 2, experts over expert-DP 1), FLOPs as Megatron-LM
    counts top-k experts, and with offload one engine per optimizer."""
    got = plan_json("--gpus-per-node", "2", "--gpu-tflops", "100", *MOE_PLAN)
    h, v, s, ffn = 64, 384, 32, 128  # SwiGLU's default FFN: 8h/3 rounded down to a multiple of 64
    attention = h + 4 * h * h  # RMSNorm, QKV and projection, no biases
    dense_mlp, expert = h + 3 * h * ffn, 3 * h * ffn  # gate, up and down
    router = 4 * h
    dense = 4 * attention + 2 * dense_mlp + 2 * (h + router) + v * h + h  # tied output layer, final norm
    experts_per_rank = 2 * 2 * expert  # two MoE layers, two of the four experts on each EP rank
    assert got["params_total"] == dense + 2 * experts_per_rank
    assert got["params_active"] == dense + 2 * 2 * expert  # top-2 of each MoE layer's experts
    assert got["params_per_rank"] == dense + experts_per_rank
    assert got["gpu_bytes_per_rank"]["optimizer_state"] == 12 * (dense // 2 + experts_per_rank)
    forward = 4 * (4 * h * h + s * h) + 2 * 3 * h * ffn + 2 * 3 * h * 2 * ffn + h * v  # multiply-adds per token
    assert got["predicted_compute_s"] == pytest.approx(3 * 2 * forward * s * 4 / 2 / 100e12, rel=1e-9)
    flags = [*MOE_PLAN, *offload_args(tmp_path, tiers=("host",))]
    off = plan_json("--gpus-per-node", "2", "--gpu-tflops", "100", "--adam-gelems", "1", "--convert-gelems", "1",
                    *flags)
    engines = off["engines"]
    assert {k: e["optimizer_state_elements_per_rank"] for k, e in engines.items()} == {
        "dense": dense // 2, "experts": experts_per_rank}
    assert off["optimizer_state_elements_per_rank"] == dense // 2 + experts_per_rank
    assert all(e["tier_bytes_per_rank"]["host"] == e["optimizer_state_bytes_per_rank"] for e in engines.values())
    # approx: the node's figure and this sum add the engines' float seconds in different orders
    assert off["predicted_update_s"] == pytest.approx(sum(e["predicted_update_s"] for e in engines.values()))
    text = io.StringIO()
    with contextlib.redirect_stdout(text):
        planner().main(["--gpus-per-node", "2", "--adam-gelems", "1", "--convert-gelems", "1", *flags])
    assert "mixture of experts: 4 experts, top-2;" in text.getvalue()
    assert "optimizer state per rank (experts):" in text.getvalue()


def test_moe_host_budget_too_small_for_the_two_engines(tmp_path):
    """The planner refuses what the training refuses (shard_budgets.check_host_split), in the same
    line: the budget as typed and its split; the budget that line suggests fits."""
    def planned(budget_gb, expect):
        flags = offload_args(tmp_path, ("host", "nvme"), budget_gb, subgroup="100000000")
        return plan_json("--gpus-per-node", "2", "--gpu-tflops", "100", "--adam-gelems", "1", "--convert-gelems",
                         "1", "--offload-nvme-capacity-gb", "1", *MOE_PLAN, *flags, expect=expect)

    refused = planned("0.001", 1)
    line = next(p for p in refused["problems"] if "starts both" in p)
    assert line.startswith("--offload-host-cache-gb 0.001 is too small for the dense and experts engines together: "
                           "split by optimizer state elements it gives dense "), line
    assert len(refused["problems"]) == 1  # not the engines' own lines after it, naming their shares
    least = re.search(r"--offload-host-cache-gb ([0-9.]+) starts both", line).group(1)
    assert set(planned(least, 0)["engines"]) == {"dense", "experts"}


def test_moe_expert_grid_must_divide_the_world():
    err = io.StringIO()
    with contextlib.redirect_stderr(err), pytest.raises(SystemExit):
        planner().main(["--gpus-per-node", "3", *[f for f in MOE_PLAN]])
    assert re.search(r"^error: --expert-model-parallel-size.* does not divide the world size 3$", err.getvalue(), re.M)


def test_what_the_guard_admits_fits(tmp_path):
    """The start-up guard's check decides: a node whose memory holds everything the guard counts fits,
    though that is more than 80% of it (a second, stricter rule refused the README's 20.68 B run, 103 of
    125 GiB per node, which the guard admitted and which trained; issue 31)."""
    flags = offload_args(tmp_path, tiers=("host",))
    got = plan_json("--gpus-per-node", "2", "--adam-gelems", "1", "--convert-gelems", "1", "--host-memory-gb", "1.1",
                    *TINY_MODEL, *flags, "--num-workers", "0")
    host = sum(got["host_bytes_per_node"].values())
    assert 0.8 * 1.1 * 2**30 < host < 1.1 * 2**30  # between the old rule and the node's memory
    assert got["fits"] and got["problems"] == []
    refused = plan_json("--gpus-per-node", "2", "--adam-gelems", "1", "--convert-gelems", "1", "--host-memory-gb", "1.0",
                        *TINY_MODEL, *flags, "--num-workers", "0", expect=1)
    assert not refused["fits"] and "more than the 1.00 GiB of the node's memory" in refused["problems"][0]


def test_moe_engines_share_the_spare_device_memory_of_an_auto_gpu_tier():
    """On a GPU job, an auto gpu tier holds what the training's own peak leaves beyond the margin: the
    dense engine takes its share first, the experts' engine what is left; nothing more."""
    flags = [f for f in MOE_PLAN if f != "cpu"] + ["--offload-tiers", "gpu,host", "--offload-gpu-cache-gb", "auto",
                                                    "--offload-subgroup-size", "2000"]
    flags[flags.index("--device") + 1:flags.index("--device") + 1] = ["cuda"]
    margin, memory = 4 * 2**30, 4 * 2**30 + int(3.5 * 2**30) + 4_000_000  # ~1.4 MB spare: part of the 1.7 MB of state
    got = plan_json("--gpus-per-node", "2", "--gpu-tflops", "100", "--adam-gelems", "1", "--convert-gelems", "1",
                    "--gpu-memory-gb", str(memory / 2**30), *flags)
    gpu = got["gpu_bytes_per_rank"]
    spare = memory - sum(v for k, v in gpu.items() if k != "optimizer_state_gpu_tier") - margin
    engines = got["engines"]
    held = {k: e["tier_bytes_per_rank"]["gpu"] for k, e in engines.items()}
    slot = {k: e["optimizer_state_bytes_per_rank"] / e["subgroups"] for k, e in engines.items()}
    assert 0 < held["dense"] <= spare and 0 < held["experts"] and held["dense"] + held["experts"] <= spare
    assert engines["experts"]["placement"]["host"] > 0  # the spare holds only part of the state
    assert spare - held["dense"] - held["experts"] < 2 * max(slot.values())  # no whole subgroup left out
    assert gpu["optimizer_state_gpu_tier"] == held["dense"] + held["experts"]


def test_a_gpu_job_is_planned_with_the_gpu_nodes_cpu_not_this_machines(monkeypatch):
    """On a login node the planner must not time its own CPU for a GPU job (a fast login node gave the host-held
    subgroups to "the CPU" and planned 13.7 s for a 2.0 s run): the GPU node's defaults, or the flags, and a
    line that says which. A CPU job still measures this machine."""
    import mlp_offload

    def no_timing(*args, **kwargs):
        raise AssertionError("the planner timed this machine's CPU")

    monkeypatch.setattr(mlp_offload, "measure_adam_rate", no_timing)
    monkeypatch.setattr(mlp_offload, "measure_convert_rate", no_timing)
    offload = ["--offload-tiers", "host", "--gpus-per-node", "1", "--gpu-memory-gb", "80", *TINY_MODEL]

    def text_of(*extra):
        out = io.StringIO()
        with contextlib.redirect_stdout(out):
            planner().main([*offload, *extra])
        return out.getvalue()

    tool = planner()
    text = text_of("--device", "cuda")
    assert (f"update rates per rank: CPU Adam {tool.GPU_NODE_CPU_ADAM_GELEMS:.2f} G elements/s (the GPU node's "
            f"default), conversion {tool.GPU_NODE_CONVERT_GELEMS:.2f} (the GPU node's default)") in text, text
    assert "CPU Adam 2.00 G elements/s (--adam-gelems)" in text_of("--device", "cuda", "--adam-gelems", "2")
    with pytest.raises(AssertionError, match="timed this machine's CPU"):
        text_of()  # TINY_MODEL's --device cpu: a CPU job, whose CPU is this machine's


def test_a_gpu_job_planned_without_a_gpu_updates_where_the_gpu_node_would():
    """pretrain_gpt.py resolves --offload-update on the node that trains (auto on a GPU): planned on a machine
    without one, a GPU job's host-held subgroups must not all go to "the CPU" (the README's 20.68 B command was
    planned at 5.69 s so, for a 2.2 s run). The flag given stays as given."""
    offload = ["--offload-tiers", "host", "--offload-subgroup-size", "2000", "--gpus-per-node", "1",
               "--gpu-memory-gb", "80", *TINY_MODEL, "--device", "cuda"]

    def update_line(*extra):
        out = io.StringIO()
        with contextlib.redirect_stdout(out):
            planner().main([*offload, *extra])
        return next(line for line in out.getvalue().splitlines() if line.startswith("predicted update"))

    subgroups = plan_json(*offload)["subgroups"]
    # at the GPU node's default rates the device streams faster than its CPU updates: all on the device
    assert f"split cpu 0/device {subgroups} subgroups" in update_line()
    assert "split" not in update_line("--offload-update", "cpu")  # all on the CPU, as asked
    # a GPU that streams slower than the node's CPU updates: the CPU takes them (the line names no split)
    assert "split" not in update_line("--gpu-streamed-gelems", "0.5")


def test_a_recommendation_prints_each_engine_warning_once(tmp_path):
    """--recommend plans every candidate through the engine's placement, which warns about each one alike."""
    flags = offload_args(tmp_path, tiers=("host", "nvme"), budget_gb="0.0005", subgroup="20000")
    done = plan("--gpus-per-node", "2", "--adam-gelems", "1", "--convert-gelems", "1", "--offload-bandwidths",
                "nvme=1:1", "--offload-nvme-capacity-gb", "1", "--recommend", *TINY_MODEL, *flags)
    shallow = [ln for ln in done.stderr.splitlines() if "fewer than prefetch depth" in ln]
    assert len(shallow) == 1, done.stderr[-2000:]
    assert len(re.findall(r"^  .*: [0-9,]+ \(iteration", done.stdout, re.M)) > 1, done.stdout  # several candidates
    assert "recommended: " in done.stdout


def test_the_text_names_the_machine_sizes_it_assumed():
    """Planned on a login node, the GPU's memory and the node's host memory are assumptions unless given:
    the text says which, and which flag gives them; given both, it says nothing of the kind."""
    def text(*flags):
        out = io.StringIO()
        with contextlib.redirect_stdout(out):
            planner().main(["--gpu-tflops", "100", *TINY_MODEL, *flags])
        return [line for line in out.getvalue().splitlines() if line.startswith("assumed: ")]

    (line,) = text()
    assert "GPU memory 80 GiB (the default; --gpu-memory-gb" in line and "(this machine's; --host-memory-gb" in line
    (line,) = text("--gpu-memory-gb", "141")
    assert "GPU memory" not in line and "--host-memory-gb" in line
    assert text("--gpu-memory-gb", "141", "--host-memory-gb", "128") == []


def test_a_file_tier_line_says_what_a_node_writes_to_it_in_a_day():
    """The endurance figure: a rank's bytes written a step, times the node's ranks, over a day of predicted steps
    (worked out here from the JSON of the same flags)."""
    flags = ["--gpus-per-node", "2", "--gpu-memory-gb", "1", "--host-memory-gb", "8", "--gpu-tflops", "100",
             "--offload-nvme-capacity-gb", "100", "--offload-bandwidths", "nvme=2.0:1.0", "--adam-gelems", "0.1",
             *TINY_MODEL, "--offload-tiers", "host,nvme", "--offload-nvme-path", "/nonexistent/nvme",
             "--offload-host-cache-gb", "0.0005", "--offload-subgroup-size", "6000"]
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        code = planner().main(flags)
    got = plan_json(*flags, expect=code)
    written = got["io_bytes_per_rank_per_step"]["nvme"]["write"]
    assert written > 0
    expected = written * 2 * 86400 / got["predicted_iteration_s"] / 1e12
    (line,) = [l for l in out.getvalue().splitlines() if l.startswith("nvme per node:")]
    assert line.endswith(f"; {expected:.1f} TB written a day per node at the predicted iteration")


@pytest.mark.parametrize("flags,at_once", [
    (["--train-iters", "10", "--save-interval", "2"], 5),                                 # every one kept
    (["--train-iters", "9", "--save-interval", "2"], 5),                                  # and the one at the end
    (["--train-iters", "10", "--save-interval", "2", "--save-retain-interval", "4"], 3),  # 4, 8 (newest), 10
    (["--train-iters", "10"], 0),                                                         # no --save-interval
])
def test_the_plan_says_how_many_checkpoints_are_on_save_at_once(flags, at_once):
    """Worked out by hand: the saves at every --save-interval and at the end, those --save-retain-interval keeps
    and the newest on the disk while the next is written."""
    got = plan_json("--gpus-per-node", "1", "--gpu-memory-gb", "80", "--gpu-tflops", "100", *TINY_MODEL,
                    "--save", "/nonexistent/ckpt", *flags)  # the planner touches no path
    assert got["checkpoints_at_once"] == at_once
