"""Offload systems side by side on one GPU machine, same model shape, in one call.

Systems (each a subprocess with its own timeout, in this order unless --systems says otherwise):
  a  ours, host only                     (--offload-tiers host)
  b  ours, host + disk                   (--offload-tiers host,nvme, host budget < state)
  d  DeepSpeed ZeRO-3, offload_optimizer nvme on the same disk
  e  DeepSpeed ZeRO-3, offload_optimizer cpu
  f  megatron-core optimizer_cpu_offload (fraction 1.0, D2H/H2D overlap) through our training layer
  g  no offload (megatron-core DistributedOptimizer on the GPU), when it fits
  c  ours, host + disk + /dev/shm as a second path: EMULATED (tmpfs is memory, not a device)
  t  ours, host + disk as b, but --offload-tokens-per-tier 4: with up to 4 ranks no node-wide I/O
     concurrency control
  s  ours, host + disk as b, but --offload-tokens-per-tier 1: the node's ranks take turns on the
     disk (b uses the default: tokens decided by the engine's probe)

--nproc N runs every system as N data-parallel ranks of one node (torchrun, one GPU each) sharing
the one disk: ours with DP=N and --offload-host-cache-gb per rank, DeepSpeed ZeRO-3 partitioned
over the N ranks with its swap files under one shared directory. Times are rank 0's.

Before them it measures the floor (disk and tmpfs bandwidth, CPU fused AdamW rate, pinned copies)
and, for the disk configurations, prints the update-phase lower bound max(Adam, bytes / bandwidth)
beside the measured update and our engine's prediction. Writes compare_offload.json to --out.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
sys.path.insert(0, HERE)
import io_floor as floor  # noqa: E402
from llama_shape import LlamaShape, add_shape_flags, shape_from_args  # noqa: E402

# ~1.03 B parameters: DeepSpeed's NVMe step stays ~15 s, so all systems fit one 9-minute call.
DEFAULT_SHAPE = LlamaShape(layers=20, hidden=2048, ffn=5632, heads=16, kv_heads=4, vocab=32000, seq=2048)
LABELS = {
    "a": "ours host",
    "b": "ours host+disk",
    "c": "ours host+disk+shm (EMULATED 2nd path)",
    "d": "DeepSpeed ZeRO-3 nvme",
    "e": "DeepSpeed ZeRO-3 cpu",
    "f": "megatron-core cpu offload",
    "g": "no offload (GPU)",
    "t": "ours host+disk, 4 I/O tokens per tier",
    "s": "ours host+disk, 1 I/O token per tier",
}
OURS = "abcfgst"
PEERS = {"a": ["e", "f"], "b": ["d"], "c": ["d"], "t": ["d", "b"], "s": ["d", "b"]}
# Seconds a system needs beyond its iterations (imports, model build, DeepSpeed's op JIT builds).
STARTUP_S = {"a": 40, "b": 45, "c": 45, "d": 120, "e": 90, "f": 45, "g": 35, "t": 45, "s": 45}
TOKENS_T = 4


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_shape_flags(p, DEFAULT_SHAPE)
    p.add_argument("--micro-batch", type=int, default=4)
    p.add_argument("--global-batch", type=int, default=None, help="default: --nproc x --micro-batch")
    p.add_argument("--nproc", type=int, default=1, help="ranks (GPUs) of one node, data-parallel, one shared disk")
    p.add_argument("--iters", type=int, default=3, help="iterations per system; the first is warm-up")
    p.add_argument("--systems", default="abdefgc", help="letters, run in this order")
    p.add_argument("--budget-s", type=float, default=480, help="wall clock for floor + all systems")
    p.add_argument("--disk-dir", default="/var/tmp/offload_cmp")
    p.add_argument("--shm-dir", default="/dev/shm/offload_cmp")
    p.add_argument("--host-budget-gb", type=float, default=4.0,
                   help="ours (b, c, t): host memory PER RANK (--offload-host-cache-gb), x nproc < the state")
    p.add_argument("--host-gb", type=float, default=None,
                   help="host memory to treat as available in the fit checks (default: MemAvailable now)")
    p.add_argument("--subgroup-size", type=float, default=1e8)
    p.add_argument("--io-threads", type=int, default=8)
    p.add_argument("--peer-offload-param", choices=["none", "cpu"], default="none",
                   help="DeepSpeed (d, e): ZeRO-Infinity's offload_param too, the bf16 params in pinned CPU memory")
    p.add_argument("--ours-flags", default="",
                   help="extra pretrain_gpt.py flags for our systems, e.g. bf16 moments or a gpu tier "
                        "('--use-precision-aware-optimizer --exp-avg-dtype bf16 --exp-avg-sq-dtype bf16')")
    p.add_argument("--floor-mb", type=int, default=2048, help="disk probe size")
    p.add_argument("--adam-numel", type=float, default=1e8)
    p.add_argument("--device", choices=["cuda", "cpu"], default="cuda", help="cpu: only for a local smoke test")
    p.add_argument("--out", default=os.environ.get("OUT") or os.path.join(REPO, "runs", "compare"),
                   help="compare_offload.json and logs.tar.gz (the per-system logs) go here")
    p.add_argument("--work-dir", default=None, help="per-system logs (default: DISK_DIR/logs)")
    args = p.parse_args(argv)
    args.shape = shape_from_args(args)
    if args.nproc < 1:
        p.error("--nproc must be >= 1")
    args.global_batch = args.global_batch or args.nproc * args.micro_batch
    if args.global_batch % (args.nproc * args.micro_batch):
        p.error("--global-batch must be a multiple of --nproc x --micro-batch")
    args.work_dir = args.work_dir or os.path.join(args.disk_dir, "logs")
    unknown = set(args.systems) - set(LABELS)
    if unknown:
        p.error(f"--systems: unknown letters {sorted(unknown)}; known: {''.join(LABELS)}")
    return args


# ----------------------------------------------------------------------------- commands

def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def ours_command(args, system: str, logs: dict) -> list:
    cmd = ["torchrun", "--nproc_per_node", str(args.nproc), "--master-port", str(_free_port()),
           os.path.join(REPO, "pretrain_gpt.py"), *args.shape.megatron_flags(),
           "--micro-batch-size", str(args.micro_batch), "--global-batch-size", str(args.global_batch),
           "--train-iters", str(args.iters), "--lr", "3e-4", "--lr-decay-style", "constant",
           "--weight-decay", "0.1", "--adam-beta1", "0.9", "--adam-beta2", "0.95", "--clip-grad", "1.0",
           "--bf16", "--mock-data", "--recompute-granularity", "full", "--recompute-method", "uniform",
           "--recompute-num-layers", "1", "--log-interval", "1", "--seed", "1234", "--device", args.device,
           "--loss-log", logs["loss"], "--timing-log", logs["timing"]]
    engine = ["--offload-subgroup-size", str(int(args.subgroup_size)), "--offload-io-threads",
              str(args.io_threads), "--offload-telemetry-log", logs["telemetry"]]
    disk = os.path.join(args.disk_dir, "ours")
    if system == "a":
        cmd += ["--offload-tiers", "host", *engine]
    elif system == "b":
        cmd += ["--offload-tiers", "host,nvme", "--offload-nvme-path", disk,
                "--offload-host-cache-gb", str(args.host_budget_gb), *engine]
    elif system in "ts":
        cmd += ["--offload-tiers", "host,nvme", "--offload-nvme-path", disk, "--offload-host-cache-gb",
                str(args.host_budget_gb), "--offload-tokens-per-tier", str(TOKENS_T if system == "t" else 1),
                *engine]
    elif system == "c":
        cmd += ["--offload-tiers", "host,nvme,shm", "--offload-nvme-path", disk,
                "--offload-shm-path", args.shm_dir, "--offload-host-cache-gb", str(args.host_budget_gb), *engine]
    elif system == "f":
        cmd += ["--optimizer-cpu-offload", "--optimizer-offload-fraction", "1.0", "--overlap-cpu-optimizer-d2h-h2d"]
    if system in "abcst":  # the engine's systems (f and g are megatron-core's)
        cmd += args.ours_flags.split()
    return cmd


def peer_command(args, system: str, logs: dict) -> list:
    launch = [sys.executable]
    if args.nproc > 1:  # deepspeed.init_distributed() reads torchrun's RANK / WORLD_SIZE / MASTER_*
        launch += ["-m", "torch.distributed.run", "--nproc_per_node", str(args.nproc),
                   "--master-port", str(_free_port())]
    return [*launch, os.path.join(HERE, "peers_deepspeed.py"), *args.shape.peer_flags(),
            "--micro-batch", str(args.micro_batch), "--global-batch", str(args.global_batch),
            "--iters", str(args.iters), "--lr", "3e-4", "--weight-decay", "0.1", "--seed", "1234",
            "--sub-group-size", str(args.subgroup_size), "--offload", "nvme" if system == "d" else "cpu",
            "--nvme-path", os.path.join(args.disk_dir, "deepspeed"), "--log-file", logs["peer"],
            "--offload-param", args.peer_offload_param]


# ----------------------------------------------------------------------------- fit checks

def _resources(args) -> dict:
    import psutil

    res = {"host_available_gb": psutil.virtual_memory().available / 1e9,
           "disk_free_gb": shutil.disk_usage(args.disk_dir).free / 1e9}
    if args.host_gb is not None:  # e.g. a machine whose memory grows on demand: MemAvailable reads low
        res["host_given_gb"] = args.host_gb
    try:
        import torch

        if args.device == "cuda" and torch.cuda.is_available():
            res["gpu_gb"] = min(torch.cuda.get_device_properties(i).total_memory
                                for i in range(max(1, args.nproc))
                                if i < torch.cuda.device_count()) / 1e9
            if args.nproc > 1:
                res["gpus"] = torch.cuda.device_count()
    except Exception:  # noqa: BLE001  (no GPU: nothing to check)
        pass
    return res


def ours_state_bytes_per_param(ours_flags: str) -> float:
    """Stored optimizer state per parameter of our systems (b, c, t, s), from --ours-flags the way
    pretrain_gpt.py reads them (the peers' runs are all --bf16): 10 by default (the master as bf16
    param + 16-bit remainders), 4.1 with fp8 moments. What their disk and shm must hold at most."""
    if REPO not in sys.path:
        sys.path.insert(0, REPO)
    from megatron.training.model import precision_aware
    from mlp_offload import STATE_TENSORS, bytes_per_param, codec_named, codecs_for

    parser = argparse.ArgumentParser(add_help=False)
    precision_aware.add_flags(parser)
    flags, _ = parser.parse_known_args(ours_flags.split())
    flags.bf16 = True
    codecs = [codec_named(name, tensor) for name, tensor in zip(precision_aware.state_dtypes(flags), STATE_TENSORS)]
    if precision_aware.param_remainders(flags):
        codecs[0] = codecs_for(["rem16"])[0]  # the master as 16-bit remainders beside the bf16 param
    return float(bytes_per_param(codecs))


def does_not_fit(args, system: str, res: dict):
    """A reason to skip, or None. Byte counts per parameter are the systems' own state layouts.

    With N ranks: state and disk are sharded (totals unchanged); host budgets, buffers and process
    overheads are per rank; GPU memory is per GPU (ours replicates bf16 params and grads, ZeRO-3
    and the distributed optimizer shard the rest)."""
    n = args.shape.num_params() / 1e9  # G params -> GB per byte/param
    N = args.nproc
    host = res.get("host_given_gb", res["host_available_gb"]) * 0.85
    disk, gpu = res["disk_free_gb"] * 0.9, res.get("gpu_gb")
    if args.device == "cpu" and system in "def":
        return "needs a CUDA device"
    if "gpus" in res and res["gpus"] < N:
        return f"needs {N} GPUs, {res['gpus']} visible"
    extra = 3 * (N - 1)  # host GB per further process (CUDA context, torch, model build)
    ours = ours_state_bytes_per_param(args.ours_flags) * n
    need = {  # (host GB, disk GB, GPU GB) -- GPU: bf16 params+grads, fp32 grad buffer, activations
        "a": (ours + 2 * n + extra, 0, 8 * n), "b": (N * args.host_budget_gb + 2 * n + extra, ours, 8 * n),
        "c": (N * args.host_budget_gb + 2 * n + extra, ours, 8 * n),
        "t": (N * args.host_budget_gb + 2 * n + extra, ours, 8 * n),
        "s": (N * args.host_budget_gb + 2 * n + extra, ours, 8 * n),
        # DeepSpeed's NVMe swapper pins buffer_count (16) sub-groups of 1e8 fp32 per rank: ~6.4 GB
        "d": (4 * n + (extra + 7 * (N - 1)), 16 * n, 4 * n / N), "e": (18 * n + extra, 0, 4 * n / N),
        "f": (23 * n + extra, 0, 8 * n), "g": (0, 0, 6 * n + 14 * n / N),
    }[system]
    if system == "c":  # the shm share is host memory too
        need = (need[0] + ours, need[1], need[2])
    if system in "de" and args.peer_offload_param == "cpu":  # the bf16 params leave the GPU for pinned host memory
        need = (need[0] + 2 * n, need[1], need[2] / 2)
    if need[0] > host:
        return f"host memory: needs ~{need[0]:.0f} GB, {host:.0f} GB available"
    if need[1] > disk:
        return f"disk: needs ~{need[1]:.0f} GB, {disk:.0f} GB free"
    if gpu is not None and need[2] > gpu * 0.85:
        return f"GPU memory: needs ~{need[2]:.0f} GB of {gpu:.0f} GB"
    return None


# ----------------------------------------------------------------------------- running

def run_system(args, system: str, deadline: float) -> dict:
    name = f"{system}_{'ours' if system in OURS else 'deepspeed'}"
    logs = {k: os.path.join(args.work_dir, f"{name}.{k}.jsonl") for k in ("loss", "timing", "telemetry", "peer")}
    if args.nproc > 1:  # one telemetry file per rank: the shared disk's traffic is the ranks' sum
        logs["telemetry"] = os.path.join(args.work_dir, f"{name}.telemetry.rank{{rank}}.jsonl")
    for path in logs.values():
        for r in range(args.nproc):
            if os.path.exists(path.replace("{rank}", str(r))):
                os.remove(path.replace("{rank}", str(r)))
    cmd = ours_command(args, system, logs) if system in OURS else peer_command(args, system, logs)
    wanted = STARTUP_S[system] + 10 * (args.nproc - 1) + args.iters * _iter_guess_s(args, system)
    left = deadline - time.time()
    result = {"system": system, "label": LABELS[system], "command": " ".join(cmd)}
    if left < min(wanted, 60):
        return {**result, "skipped": f"time budget: {left:.0f} s left, ~{wanted:.0f} s needed"}
    # Generous against the estimate (DeepSpeed's JIT builds vary), but a hung run cannot eat everything.
    timeout = min(left, max(3 * wanted, wanted + 120))
    threads = max(1, (os.cpu_count() or 1) // args.nproc)  # the node's cores, shared by its ranks
    env = dict(os.environ, PYTHONUNBUFFERED="1", OMP_NUM_THREADS=str(threads),
               PYTHONPATH=os.pathsep.join(filter(None, [REPO, os.environ.get("PYTHONPATH")])))
    print(f"\n=== {system}: {LABELS[system]} (timeout {timeout:.0f} s, expected ~{wanted:.0f} s)", flush=True)
    log_path = os.path.join(args.work_dir, f"{name}.log")
    io_before = _disk_io()
    start = time.time()
    with open(log_path, "w") as log:
        proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT,
                                start_new_session=True)
        try:
            rc = proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            _stop(proc)
            rc = "timeout"
    result["wall_s"] = time.time() - start
    result["disk_io_gb"] = _io_delta(io_before, _disk_io())
    result["log"] = os.path.basename(log_path)
    _cleanup(args, system)
    tail = _tail(log_path)
    parsed = parse_ours(args, logs, log_path) if system in OURS else parse_peer(logs)
    result.update(parsed)
    summarize(result)
    if rc != 0:
        result["skipped"] = (f"timed out after {timeout:.0f} s" if rc == "timeout" else f"exit status {rc}") + (
            f" ({len(parsed.get('iterations', []))} iterations done)")
        result["log_tail"] = tail
        print(tail, flush=True)
    else:
        print(f"    done in {result['wall_s']:.0f} s: {_summary_text(result)}", flush=True)
    return result


def _iter_guess_s(args, system: str) -> float:
    n = args.shape.num_params() / 1e9
    # Disk-bound systems share one disk however many ranks there are: same guess per iteration.
    return {"a": 1.0 + n, "b": 1.0 + 8 * n, "c": 1.0 + 3 * n, "d": 2 + 14 * n,
            "e": 1 + 2 * n, "f": 1 + n, "g": 1.0, "t": 1.0 + 8 * n, "s": 1.0 + 8 * n}[system]


def _stop(proc) -> None:
    """SIGTERM the run's process group (our training loop then removes its swap files), then kill."""
    for sig, grace in ((signal.SIGTERM, 20), (signal.SIGKILL, 10)):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return
        try:
            proc.wait(timeout=grace)
            return
        except subprocess.TimeoutExpired:
            continue


def _cleanup(args, system: str) -> None:
    # Swap files of a killed run would take the next system's disk space.
    for path in (os.path.join(args.disk_dir, "ours"), os.path.join(args.disk_dir, "deepspeed"), args.shm_dir):
        if os.path.isdir(path):
            for entry in os.listdir(path):
                if not entry.startswith(".mlp_offload_probe"):  # keep the cached bandwidth probe
                    full = os.path.join(path, entry)
                    shutil.rmtree(full, ignore_errors=True) if os.path.isdir(full) else os.remove(full)


def _disk_io():
    try:
        import psutil

        c = psutil.disk_io_counters()
        return (c.read_bytes, c.write_bytes) if c else None
    except Exception:  # noqa: BLE001
        return None


def _io_delta(before, after):
    if not before or not after:
        return None
    return {"read": (after[0] - before[0]) / 1e9, "write": (after[1] - before[1]) / 1e9}


def _tail(path: str, lines: int = 15) -> str:
    with open(path, errors="replace") as f:
        text = [l for l in f.read().splitlines() if "Warning" not in l and "warn(" not in l]
    return "\n".join("    | " + l[:300] for l in text[-lines:])


def _read_jsonl(path: str) -> list:
    if not os.path.exists(path):
        return []
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def parse_ours(args, logs: dict, log_path: str) -> dict:
    timing = {r["iteration"]: r for r in _read_jsonl(logs["timing"])}  # rank 0's (the logging rank)
    losses = {r["iteration"]: r["loss"] for r in _read_jsonl(logs["loss"])}
    ranks = [[r for r in _read_jsonl(logs["telemetry"].replace("{rank}", str(k))) if not r.get("skipped")]
             for k in range(args.nproc)]
    telemetry = ranks[0]
    iterations = []
    for i, (it, t) in enumerate(sorted(timing.items())):
        rec = {"iteration": it, "iteration_s": t["elapsed_s"], "fb_s": t["forward_backward_s"],
               "update_s": t["optimizer_s"], "loss": losses.get(it)}
        if t.get("forward_s") is not None:  # the schedule's compute timers (older logs lack them)
            rec.update(forward_s=t["forward_s"], backward_s=t["backward_s"])
        if i < len(telemetry):
            tel = telemetry[i]
            rec.update(engine_update_s=tel["update_s"], predicted_update_s=tel["predicted_update_s"],
                       adam_s=tel["adam_s"], convert_s=tel["convert_s"],
                       wait_s=tel["read_wait_s"], cache_hits=tel["cache_hits"],
                       streamed=tel["streamed"],
                       traffic={k: (v["read_bytes"], v["write_bytes"]) for k, v in tel["tiers"].items()})
            if args.nproc > 1:  # what all ranks moved on each tier this step (one shared disk)
                others = [rk[i] for rk in ranks if i < len(rk)]
                rec["ranks_reporting"] = len(others)
                rec["traffic"] = {k: (sum(o["tiers"][k]["read_bytes"] for o in others),
                                      sum(o["tiers"][k]["write_bytes"] for o in others)) for k in tel["tiers"]}
                rec["token_wait_s"] = [sum(v.get("token_wait_s", 0.0) for v in o["tiers"].values()) for o in others]
                rec["engine_update_s_ranks"] = [o["update_s"] for o in others]
        iterations.append(rec)
    with open(log_path, errors="replace") as f:
        text = f.read()
    m = re.search(r"> model parameters \(all stages, one replica\): (\d+)", text)
    params = int(m.group(1)) if m else None
    # The iteration the training predicted beside each measured one (its console line, log interval 1)
    predicted = {int(it): float(ms) / 1000 for it, ms in re.findall(
        r"iteration +(\d+)/.*?offload predicted iteration time \(ms\): ([0-9.]+)", text)}
    for rec in iterations:
        if rec["iteration"] in predicted:
            rec["predicted_iteration_s"] = predicted[rec["iteration"]]
    return {"parameters": params, "iterations": iterations}


def parse_peer(logs: dict) -> dict:
    records = _read_jsonl(logs["peer"])
    out = {"iterations": []}
    for r in records:
        if "parameters" in r:
            out["parameters"] = r["parameters"]
        elif "initialize_s" in r:
            out["initialize_s"] = r["initialize_s"]
        elif "deepspeed_config" in r:
            out["deepspeed_config"] = r["deepspeed_config"]
        elif "iteration" in r:
            out["iterations"].append({"iteration": r["iteration"], "iteration_s": r["total_s"],
                                      "fb_s": r["forward_s"] + r["backward_s"], "update_s": r["step_s"],
                                      "forward_s": r["forward_s"], "backward_s": r["backward_s"],
                                      "loss": r["loss"], "gpu_peak_gb": r.get("gpu_peak_gb")})
    return out


# ----------------------------------------------------------------------------- summary

def summarize(result: dict) -> None:
    """Medians over the iterations after the first (warm-up), or the only one."""
    its = result.get("iterations") or []
    steady = its[1:] if len(its) > 1 else its
    if not steady:
        return
    med = lambda key: statistics.median(r[key] for r in steady)  # noqa: E731
    result["median"] = {k: med(k) for k in ("iteration_s", "fb_s", "update_s")}
    for key in ("forward_s", "backward_s", "engine_update_s", "predicted_update_s", "adam_s"):
        if all(key in r for r in steady):
            result["median"][key] = med(key)
    predicted = [r["predicted_iteration_s"] for r in steady if "predicted_iteration_s" in r]
    if predicted:
        result["median"]["predicted_iteration_s"] = statistics.median(predicted)
    if all("token_wait_s" in r for r in steady):  # --nproc > 1: waiting for another rank's I/O token
        result["median"]["token_wait_s_mean_rank"] = statistics.median(
            sum(r["token_wait_s"]) / len(r["token_wait_s"]) for r in steady)


def add_floors(args, results: dict, fl: dict) -> None:
    """Update-phase lower bound: max(Adam over all params, bytes moved / bandwidth of its device)."""
    n = args.shape.num_params()
    adam_s = n / fl["adam"]["params_per_s"]
    bw = {"nvme": fl["disk"], "shm": fl.get("shm")}
    for system in ("b", "c", "t", "s"):
        r = results.get(system)
        if not r or "median" not in r:
            continue
        steady = r["iterations"][1:] or r["iterations"]
        traffic = [it.get("traffic") for it in steady if it.get("traffic")]
        if not traffic:
            continue
        traffic = [{k: v for k, v in t.items() if bw.get(k)} for t in traffic]  # file tiers only
        io = statistics.median(floor.io_seconds(t, bw) for t in traffic)
        r["floor"] = {"adam_s": adam_s, "io_s": io, "update_floor_s": max(adam_s, io),
                      "basis": "bytes our engine moved per step (all ranks) / probed bandwidth"}
    r = results.get("d")
    if r and "median" in r:
        # DeepSpeed's step reads fp32 params, m, v and grads (16 B/param) and writes params, m, v (12 B).
        io = floor.io_seconds({"nvme": (16 * n, 12 * n)}, {"nvme": fl["disk"]})
        r["floor"] = {"adam_s": adam_s, "io_s": io, "update_floor_s": max(adam_s, io),
                      "basis": "16 B/param read + 12 B/param written (DeepSpeed's layout) / probed bandwidth"}
    for system in ("a", "e", "f"):
        r = results.get(system)
        if r and "median" in r:
            r["floor"] = {"adam_s": adam_s, "io_s": 0.0, "update_floor_s": adam_s, "basis": "CPU fused AdamW"}


def _summary_text(r: dict) -> str:
    m = r.get("median")
    if not m:
        return "no iterations parsed"
    pred = f" (predicted {m['predicted_iteration_s']:.2f} s)" if "predicted_iteration_s" in m else ""
    return f"iteration {m['iteration_s']:.2f} s{pred}, fwd+bwd {m['fb_s']:.2f} s, update {m['update_s']:.2f} s"


def print_table(results: dict, order: str, title: str = "") -> str:
    rows = [title] if title else []
    head = (f"{'':2} {'system':40} {'iter s':>8} {'fwd s':>6} {'bwd s':>6} {'fwd+bwd s':>9} {'update s':>9} {'floor s':>8} "
            f"{'pred s':>7}  {'vs peer (peer iter / this iter)':32} {'vs no-offload':>13}")
    rows += [head, "-" * len(head)]
    base = results.get("g", {}).get("median")
    for s in order:
        r = results.get(s)
        if r is None:
            continue
        m = r.get("median")
        if not m or ("skipped" in r and len(r.get("iterations", [])) < 2):
            rows.append(f"{s:2} {r['label']:40} SKIPPED: {r.get('skipped', 'no iterations')}")
            continue
        peers = []
        for p in PEERS.get(s, []):
            pm = results.get(p, {}).get("median")
            peers.append(f"{p}: {pm['iteration_s'] / m['iteration_s']:.2f}x" if pm else f"{p}: n/a")
        fl = r.get("floor", {}).get("update_floor_s")
        pred = m.get("predicted_update_s")
        vs_g = f"{m['iteration_s'] / base['iteration_s']:.2f}x" if base else "n/a"
        fwd, bwd = m.get("forward_s", float("nan")), m.get("backward_s", float("nan"))
        rows.append(f"{s:2} {r['label']:40} {m['iteration_s']:8.2f} {fwd:6.2f} {bwd:6.2f} {m['fb_s']:9.2f} {m['update_s']:9.2f} "
                    f"{fl if fl is not None else float('nan'):8.2f} {pred if pred is not None else float('nan'):7.2f}"
                    f"  {', '.join(peers):32} {vs_g:>13}" + ("  (partial: " + r["skipped"] + ")" if "skipped" in r else ""))
    text = "\n".join(rows)
    print("\n" + text, flush=True)
    return text


# ----------------------------------------------------------------------------- main

def measure_floor(args) -> dict:
    import torch

    t0 = time.time()
    fl = {"disk": floor.file_bandwidth(os.path.join(args.disk_dir, "floor"), args.floor_mb << 20,
                                       threads=args.io_threads)}
    if "c" in args.systems:
        fl["shm"] = floor.file_bandwidth(os.path.join(args.shm_dir, "floor"), args.floor_mb << 20,
                                         threads=args.io_threads, odirect=False)
    fl["adam"] = floor.adam_rate(int(args.adam_numel))
    fl["pinned"] = floor.pinned_copy() if args.device == "cuda" else {"skipped": "--device cpu"}
    fl["seconds"] = time.time() - t0
    torch.cuda.empty_cache() if torch.cuda.is_available() else None
    d, a = fl["disk"], fl["adam"]
    print(f"floor: disk read {d['read_gbps']:.2f} write {d['write_gbps']:.2f} both at once {d['mixed_gbps']:.2f} GB/s "
          f"(O_DIRECT {d['odirect']}, "
          f"{d['bytes'] >> 20} MiB, {d['threads']} threads)"
          + (f" | shm read {fl['shm']['read_gbps']:.2f} write {fl['shm']['write_gbps']:.2f} GB/s" if "shm" in fl else "")
          + f" | fused AdamW {a['params_per_s'] / 1e9:.2f} G params/s ({a['threads']} threads)"
          + "".join(f" | {k} {v:.1f}" for k, v in fl["pinned"].items() if k.endswith("gbps"))
          + f" ({fl['seconds']:.0f} s)", flush=True)
    return fl


def main(argv=None) -> None:
    args = parse_args(argv)
    start = time.time()
    deadline = start + args.budget_s
    os.makedirs(args.out, exist_ok=True)
    shutil.rmtree(args.work_dir, ignore_errors=True)
    os.makedirs(args.work_dir)
    os.makedirs(os.path.join(args.disk_dir, "ours"), exist_ok=True)
    if "c" in args.systems:
        os.makedirs(args.shm_dir, exist_ok=True)
    shape = args.shape
    n = shape.num_params()
    print(f"model {shape.as_dict()}: {n / 1e9:.3f} G params | state: ours "
          f"{ours_state_bytes_per_param(args.ours_flags) * n / 1e9:.1f} GB (master, m, v as stored), DeepSpeed "
          f"{16 * n / 1e9:.1f} GB (fp32 param, m, v, grads) | host budget (b, c, t) "
          f"{args.host_budget_gb} GB"
          + (f" PER RANK x {args.nproc} ranks = {args.nproc * args.host_budget_gb:g} GB" if args.nproc > 1 else "")
          + f" | micro-batch {args.micro_batch}, global batch {args.global_batch}, "
          f"{args.iters} iterations per system, budget {args.budget_s:.0f} s", flush=True)
    res = _resources(args)
    print("resources: " + ", ".join(f"{k} {v:.1f}" for k, v in res.items()), flush=True)
    fl = measure_floor(args)
    results = {}
    for system in args.systems:
        reason = does_not_fit(args, system, res)
        if reason:
            results[system] = {"system": system, "label": LABELS[system], "skipped": f"does not fit: {reason}"}
            print(f"\n=== {system}: {LABELS[system]}: skipped ({reason})", flush=True)
            continue
        results[system] = run_system(args, system, deadline)
    add_floors(args, results, fl)
    counts = {s: r.get("parameters") for s, r in results.items() if r.get("parameters")}
    print(f"\nparameter counts: analytic {n}; " + ", ".join(f"{s} {c}" for s, c in counts.items())
          + ("" if all(c == n for c in counts.values()) else "  <-- MISMATCH"), flush=True)
    for s in "bctsd":
        r = results.get(s, {})
        if "floor" in r:
            f, m = r["floor"], r["median"]
            print(f"update phase {s} ({r['label']}): measured {m['update_s']:.2f} s"
                  + (f" (engine {m['engine_update_s']:.2f} s, predicted {m['predicted_update_s']:.2f} s)"
                     if "engine_update_s" in m else "")
                  + f" | floor max(Adam {f['adam_s']:.2f} s, I/O {f['io_s']:.2f} s) = {f['update_floor_s']:.2f} s"
                  + f" | measured / floor {m['update_s'] / f['update_floor_s']:.2f}"
                  + (f" | I/O token wait {m['token_wait_s_mean_rank']:.2f} s per rank"
                     if "token_wait_s_mean_rank" in m else ""), flush=True)
    title = ""
    if args.nproc > 1:
        each = "one GPU each" if args.device == "cuda" else "CPU processes"
        title = (f"{args.nproc} ranks of one node (DP={args.nproc}, {each}), one shared disk | ours: host "
                 f"budget {args.host_budget_gb:g} GB PER RANK ({args.nproc * args.host_budget_gb:g} GB in all), "
                 f"I/O tokens per tier b: the engine's choice (default), s: 1, t: {TOKENS_T} | micro-batch {args.micro_batch} per rank, "
                 f"global batch {args.global_batch} | seconds are rank 0's")
    table = print_table(results, args.systems, title)
    out = {"shape": shape.as_dict(), "micro_batch": args.micro_batch, "global_batch": args.global_batch,
           "nproc": args.nproc, "tokens_t": TOKENS_T,
           "iters": args.iters, "host_budget_gb": args.host_budget_gb, "resources": res, "floor": fl,
           "systems": results, "order": args.systems, "table": table, "wall_s": time.time() - start}
    path = os.path.join(args.out, "compare_offload.json")
    with open(path, "w") as f:
        json.dump(out, f, indent=1, default=str)
    # One archive: the device tool brings back only a few files from $OUT.
    archive = shutil.make_archive(os.path.join(args.out, "logs"), "gztar", args.work_dir)
    print(f"wrote {path} and {archive} ({time.time() - start:.0f} s in all)", flush=True)


if __name__ == "__main__":
    main()
