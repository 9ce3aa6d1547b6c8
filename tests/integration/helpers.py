"""Helpers the integration tests share: the offload flags of the shared runs, the mixture-of-experts
model's flags, the layer-major step's, checkpoint copies, a resume checked against the run it left, the
offloaded optimizer state of a checkpoint as whole global tensors (the independent readout resharding tests
compare), a torch_dist checkpoint's weights as whole tensors, the half-away reference run, and the planner
tool's JSON from this process."""

import contextlib
import importlib.util
import io
import json
import shutil

import torch

from launch import REPO, pretrain_command, pretrain_env, read_loss_log, run_and_clean_up, run_pretrain

HALF_AWAY = REPO / "tests" / "integration" / "half_away_megatron.py"
SEQUENCE_PARALLEL = REPO / "tests" / "integration" / "sequence_parallel_pretrain.py"  # SP on the CPU
PLANNER = REPO / "tools" / "plan_offload.py"

# A mixture-of-experts variant of the tiny model: 4 experts of SwiGLU, top-2, RoPE and RMSNorm.
MOE = ["--num-experts", "4", "--moe-router-topk", "2", "--moe-aux-loss-coeff", "1e-2", "--swiglu",
       "--disable-bias-linear", "--normalization", "RMSNorm", "--position-embedding-type", "rope"]

# What the layer-major step needs (full recompute of single layers, no dropout), with the embedding untied from
# the output layer (tied, the shared weight's grad rounds differently).
LAYER_MAJOR_RUN = ["--recompute-granularity", "full", "--recompute-method", "uniform", "--recompute-num-layers", "1",
                   "--hidden-dropout", "0", "--attention-dropout", "0", "--untie-embeddings-and-output-weights"]


def offload_args(tmp_path, tiers=("host", "nvme", "pfs"), budget_gb="0.0005", subgroup="6000", extra=(),
                 remainders=False):
    """The offload flags of the shared runs. Without ``remainders`` the whole fp32 master is kept, so
    the model's params round to nearest even as megatron-core's do (bit-for-bit comparisons with it);
    test_remainders_cpu runs the default."""
    args = ["--offload-tiers", ",".join(tiers), "--offload-subgroup-size", subgroup,
            "--offload-adam-kernel", "single", "--offload-io-block-mb", "1", "--offload-io-threads", "2"]
    if not remainders:
        args.append("--no-store-param-remainders")
    rates = []
    for tier in tiers:
        if tier != "host":
            path = tmp_path / tier
            path.mkdir(parents=True, exist_ok=True)
            args += [f"--offload-{tier}-path", str(path)]
            rates.append(f"{tier}=2:1")
    if "host" in tiers and len(tiers) > 1:
        args += ["--offload-host-cache-gb", budget_gb]
    if rates:
        args += ["--offload-bandwidths", ",".join(rates)]
    return args + list(extra)


def copy_checkpoint(root, iterations, into):
    """A checkpoint root of its own holding ``root``'s checkpoints of ``iterations``, the tracker at
    the last: what a run that stopped after saving the last of them leaves."""
    into.mkdir(parents=True, exist_ok=True)
    for iteration in iterations:
        name = f"iter_{iteration:07d}"
        shutil.copytree(root / name, into / name)
    (into / "latest_checkpointed_iteration.txt").write_text(str(max(iterations)))
    return into


def assert_resume_repeats_the_run(tmp_path, flags, saved_at=2, train_iters=4):
    """A run of ``flags`` saving at ``saved_at`` and going on to ``train_iters``, and a resume from that save alone
    (copied off, as a run that stopped there leaves it): the resumed iterations are the whole run's, bit for bit."""
    whole = run_pretrain(tmp_path / "whole", [*flags, "--save", str(tmp_path / "ckpt"), "--save-interval",
                                              str(saved_at)], train_iters=train_iters)
    saved = copy_checkpoint(tmp_path / "ckpt", [saved_at], tmp_path / f"at{saved_at}")
    resumed = run_pretrain(tmp_path / "resumed", [*flags, "--load", str(saved)], train_iters=train_iters)
    assert [r["iteration"] for r in resumed] == list(range(saved_at + 1, train_iters + 1))
    assert resumed == [r for r in whole if r["iteration"] > saved_at]


def global_offload_state(iteration_dir):
    """key -> [master, exp_avg, exp_avg_sq] as whole global tensors, from every position's offload
    files of both kinds (dense and experts), placed by their recorded geometry alone. Saved copies
    of one piece (TP replicas, the tied output layer) must agree, and every element must be saved."""
    from megatron.training.checkpoint.offload_files import ParamGeometry
    from megatron.training.checkpoint.offloaded_state import SavedOffloadState

    state = {}
    with SavedOffloadState(str(iteration_dir)) as saved:
        for kind in saved.kinds():
            for pp, tp in saved.positions(kind):
                files = saved.position(kind, pp, tp)
                for name, entry in files.geometry.items():
                    geometry = ParamGeometry.from_json(entry)
                    local = [torch.empty(geometry.numel) for _ in range(3)]
                    files.read_by_name(name, 0, geometry.numel, local)
                    full = state.setdefault(geometry.key, [torch.full(geometry.global_shape, float("nan"))
                                                           for _ in range(3)])
                    cut = tuple(slice(o, o + n) for o, n in zip(geometry.global_offset, geometry.local_shape))
                    for tensor, piece in zip(full, local):
                        piece = piece.view(geometry.local_shape)
                        assert torch.isnan(tensor[cut]).all() or torch.equal(tensor[cut], piece), name
                        tensor[cut] = piece
    for key, tensors in state.items():
        assert not any(torch.isnan(t).any() for t in tensors), f"{key} not fully covered"
    return state


def assert_same_state(a, b):
    """Two ``global_offload_state`` readouts hold the same keys and bits; where one layout pads the
    vocabulary further, the rows both have."""
    assert sorted(a) == sorted(b)
    for key in a:
        for x, y in zip(a[key], b[key]):
            common = tuple(slice(0, min(m, n)) for m, n in zip(x.shape, y.shape))
            assert torch.equal(x[common], y[common]), key


def run_variant(script, tmp, extra, train_iters, nproc=2):
    """``script``, a test's variant of pretrain_gpt.py, launched on ``nproc`` ranks as run_pretrain launches
    pretrain_gpt.py: its loss-log records."""
    tmp.mkdir(parents=True, exist_ok=True)
    loss_log = tmp / "loss.jsonl"
    cmd = pretrain_command(extra, nproc, train_iters, loss_log, warm=True, script=script)
    code, output = run_and_clean_up(cmd, pretrain_env(), 240, tmp / "out.txt")
    assert code == 0, output[-4000:]
    return read_loss_log(loss_log)


def half_away_megatron(tmp, extra, train_iters):
    """megatron-core's optimizer, its main -> model param copy rounding half away (half_away_megatron.py):
    the reference of the remainders."""
    return run_variant(HALF_AWAY, tmp, extra, train_iters)


def planner():
    """tools/plan_offload.py as a module of this process."""
    spec = importlib.util.spec_from_file_location("plan_offload_tool", PLANNER)
    tool = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tool)
    return tool


def plan_json(*flags, expect=0):
    """The tool's --json output and exit status, from its main() in this process."""
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        code = planner().main(["--json", *flags])
    assert code == expect, out.getvalue()
    return json.loads(out.getvalue())


def global_weights(iteration_dir):
    """key -> the whole tensor, from a torch_dist checkpoint's files (its layout is global)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    reader = dcp.FileSystemReader(str(iteration_dir))
    tensors = {key: torch.empty(meta.size, dtype=meta.properties.dtype)
               for key, meta in reader.read_metadata().state_dict_metadata.items()
               if isinstance(meta, TensorStorageMetadata)}
    dcp.load(tensors, storage_reader=reader, no_dist=True)
    return tensors
