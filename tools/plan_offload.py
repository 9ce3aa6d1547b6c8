"""Will it fit? Plan a pretrain_gpt.py run before submitting it.

  python tools/plan_offload.py --nnodes 4 --gpus-per-node 8 --gpu-memory-gb 80 --host-memory-gb 1024 \\
      --offload-nvme-capacity-gb 3500 --offload-pfs-capacity-gb 100000 \\
      --offload-bandwidths nvme=6.0:5.0,pfs=2.0:2.0 --adam-gelems 2.0 \\
      <pretrain_gpt.py's own model, parallelism and --offload-* flags>

Prints whether the run fits, where every byte goes (GPU memory, host memory, each file tier),
what a node writes to each file tier in a day (against its drives' rated endurance),
the predicted iteration time and its bottleneck, tokens/s at several global batch sizes, what one
checkpoint writes and how many are on --save at once, and the flags to use; ``--json`` prints the same as one
object. ``--hf-config DIR/config.json`` takes the
model's flags from a Hugging Face config (those tools/hf_checkpoint.py import writes to model_args.txt);
flags given after it override them. ``--recommend`` also plans every recompute
granularity x micro-batch size x gpu tier for the run's global batch size and names the fastest
that fits. With ``--offload-bandwidths`` and a capacity per file tier nothing is probed and no path
is touched, so a cluster can be planned from a laptop; without them the paths given are probed on
this node, as the engine does at start-up.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import os
import re
import shlex
import sys
import warnings

warnings.simplefilter("ignore")  # megatron-core warns at import about optional packages
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from megatron.training.checkpoint.save_agreement import checkpoints_on_disk, planned_saves  # noqa: E402
from megatron.training.errors import UserError, reported_once  # noqa: E402
from megatron.training.offload.options import HOST_CACHE_FLAG  # noqa: E402
from mlp_offload import GPU_TIER, HOST_TIER, GiB, MeasuredRates, codecs_for, kind_of  # noqa: E402

# Sustained bf16 TFLOP/s per GPU (as Megatron-LM counts FLOPs) our training reached on one H200 with
# megatron-core's local layers and full recompute, by the attention kernel that runs: 10.24 B at global batch 1,
# its iteration less its update (tests/unit/test_plan_replay.py derives both from the logs). Used where
# --gpu-tflops is not given; smaller models reach less (3.0 B: about 170), so a short run's own figure is better.
# Mixture-of-experts models: what Mixtral 8x7B's shape reached on four H200s at EP4 with megatron-core's
# SequentialMLP experts (the experts' module without transformer-engine's grouped GEMM) and SDPA, iterations 3-5 of
# docs/results/x4_2026-11-26d/moe_large_iterations.txt (180.4, 169.0, 174.9 as the log counts them, update 5-8 ms).
MEASURED_H200_TFLOPS = {"unfused": 216.7, "sdpa": 334.5, "sequential_experts": 174.8}
# The device update's rates where no run of yours gave them, from one-pass runs on H200 machines
# (docs/benchmarks.md §10 and §14): resident 200 G elements/s, what the 10.24 B steps ran with the kernel on the
# model's own grads and params (10.24 G elements in 50 ms; its start-up probe read 241); one GPU's
# host link ~100 GB/s both ways together (streamed 8.37, 5.00, 4.2 G elements/s at 6, 10, 12 stored
# bytes each); four GPUs of one node streamed ~186 GB/s together (call8_x4_tp2pp2.log).
DEFAULT_GPU_ADAM_GELEMS = 200.0  # for rem16/bf16/bf16 state (18 bytes an element moves): scaled for others
# 8-bit moments run their own kernel (decode, AdamW, block absmax, encode): alone on 1.34e8 elements in HBM it ran
# 95 G elements/s (one H100, docs/benchmarks.md §17). On the model's own grads and params (the default since
# 2026-11-28) the engine's start-up probe read 88.7-94.1 on an H200 in four runs (20.68 B and 25.36 B,
# docs/benchmarks.md §19), and the 20.68 B steady update matched the plan made with it; through copies of the grads
# and params (--offload-no-update-in-model-buffers) it reads 31-34: give --gpu-adam-gelems 32 for that path.
# Not scaled by bytes: it is not bound by them.
DEFAULT_GPU_ADAM_8BIT_GELEMS = 93.0
# A GPU job's CPU side where no run gave it: what the CPU of one H200 node (16 cores) ran, never the planning
# machine's (a login node plans for the GPU nodes): CPU Adam 3.4-3.9 G elements/s on its 16 cores (shared/reference.md,
# 2026-11-22; issue 39 says 3-4 for the one-pass kernel), and its bf16 -> fp32 copy at 34 GB/s on 16 threads
# (shared/reference.md), taken here as 8.5 G elements/s (4 bytes written each): an assumption, not a run of ours.
GPU_NODE_CPU_ADAM_GELEMS = 3.5
GPU_NODE_CONVERT_GELEMS = 8.5
GPU_MEMORY_DEFAULT_GB = 80.0  # an 80 GB-class GPU, GiB usable; --gpu-memory-gb for others
DEFAULT_GPU_LINK_GBPS = 100.0
DEFAULT_NODE_HOST_GBPS = 186.0
DEVICE_FLAGS = (  # (flag, default, help): the device update's rates, positive numbers
    ("--gpu-adam-gelems", None,
     f"device update of state kept in HBM, G elements/s (the start-up line's 'resident'; default "
     f"{DEFAULT_GPU_ADAM_GELEMS:.0f} for 16-bit remainders and bf16 moments, less for wider state: by the bytes an "
     f"element moves)"),
    ("--gpu-streamed-gelems", None, "host state streamed through one GPU alone, G elements/s (the start-up "
     "line's 'streamed'; default: --gpu-link-gbps over twice the stored bytes per element)"),
    ("--gpu-link-gbps", DEFAULT_GPU_LINK_GBPS, "one GPU's host link, GB/s both directions together"),
    ("--node-host-gbps", DEFAULT_NODE_HOST_GBPS, "host memory bandwidth the node's GPUs' streams share, GB/s"),
    ("--cpu-beside-gelems", None, "CPU Adam while the GPU streams, G elements/s (the start-up line's 'beside "
     "the CPU: ... cpu'; without it and the next, no CPU/GPU split is credited)"),
    ("--gpu-streamed-beside-gelems", None, "the GPU's stream while the CPU updates, G elements/s ('beside the "
     "CPU: streamed')"),
)
_CAPACITY_FLAG = re.compile(r"^--offload-([A-Za-z0-9_]+)-capacity-gb(?:=(.*))?$")


class _Parser(argparse.ArgumentParser):
    def error(self, message):
        raise UserError(message)


class _BothHelps(argparse.Action):
    """-h: the planner's own flags, then pretrain_gpt.py's (model, parallelism, --offload-*) it reads."""

    def __init__(self, option_strings, dest, **kwargs):
        super().__init__(option_strings, dest, nargs=0, default=argparse.SUPPRESS, help="show this help and exit")

    def __call__(self, parser, namespace, values, option_string=None):
        from megatron.training.args.arguments import build_parser

        training = build_parser().format_help().split("\n\n", 1)[-1]
        print(f"{parser.format_help()}\npretrain_gpt.py's flags, which the planner reads (the model, its "
              f"parallelism, --offload-*; data, training-length and learning-rate flags it fills in if absent):"
              f"\n\n{training}")
        parser.exit()


def _daily_writes(per_node_step: float, iteration_s) -> str:
    """What a node writes to a tier in a day of steps at the predicted pace: the figure a drive's endurance (its
    rated drive writes per day, or total TB written) is read against."""
    if not per_node_step or not iteration_s:
        return ""
    return f"; {per_node_step * 86400 / iteration_s / 1e12:.1f} TB written a day per node at the predicted iteration"


def machine_parser() -> argparse.ArgumentParser:
    p = _Parser(description=__doc__.split("\n\n")[0], add_help=False, allow_abbrev=False)
    p.add_argument("-h", "--help", action=_BothHelps)
    p.add_argument("--hf-config", default=None, metavar="DIR/config.json",
                   help="the model's flags from a Hugging Face config.json (or its directory), as tools/"
                        "hf_checkpoint.py import derives them; pretrain_gpt.py flags given too override them")
    p.add_argument("--nnodes", type=int, default=1, help="nodes in the job (default 1)")
    p.add_argument("--gpus-per-node", type=int, default=1, help="ranks per node")
    p.add_argument("--gpu-memory-gb", type=float, default=GPU_MEMORY_DEFAULT_GB,
                   help=f"memory of one GPU, GiB (default: {GPU_MEMORY_DEFAULT_GB:g})")
    p.add_argument("--host-memory-gb", type=float, default=None, help="memory of one node, GiB (default: this node's)")
    p.add_argument("--gpu-tflops", type=float, default=None,
                   help="sustained TFLOP/s per GPU for this model (from a short run's log); default: the rate measured "
                        "for the flags' attention kernel (or MoE layers), scaled to their recompute")
    p.add_argument("--adam-gelems", type=float, default=None,
                   help=f"CPU Adam rate of one rank in G elements/s (default: measured on this CPU for a CPU job; "
                        f"for a GPU job {GPU_NODE_CPU_ADAM_GELEMS}, what one H200 node's CPU ran)")
    p.add_argument("--convert-gelems", type=float, default=None,
                   help=f"gradient conversion rate of one rank in G elements/s (default: measured on this CPU for "
                        f"a CPU job; for a GPU job {GPU_NODE_CONVERT_GELEMS})")
    for flag, default, text in DEVICE_FLAGS:
        p.add_argument(flag, type=float, default=default, help=text)
    p.add_argument("--global-batch-sizes", type=str, default=None,
                   help="comma list for the tokens/s table (default: the run's, and 2x, 4x, 8x it)")
    p.add_argument("--recommend", action="store_true",
                   help="also plan every recompute granularity x micro-batch size x gpu tier (auto or none) for the "
                        "run's global batch size and name the fastest that fits")
    p.add_argument("--layouts", type=str, default=None,
                   help="with --recommend, also try these tensor x pipeline parallel sizes: 'auto' (every TP within "
                        "a node x PP dividing the layers) or a comma list of TPxPP, e.g. 4x1,2x2")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    return p


def split_capacities(rest):
    """Take ``--offload-NAME-capacity-gb GB`` pairs out; the rest are pretrain_gpt.py's flags."""
    from megatron.training.args.offload import take_named_flags

    def fail(line):
        raise UserError(line)

    given, flags = take_named_flags(rest, _CAPACITY_FLAG, "a number of GB", fail)
    capacities = {}
    for name, value in given.items():
        try:
            gb = float(value)
            assert gb >= 0 and gb != float("inf")
        except (ValueError, AssertionError):
            raise UserError(f"argument --offload-{name}-capacity-gb: expected a number of GB >= 0, "
                            f"got {value!r}") from None
        capacities[name] = int(gb * GiB)
    return capacities, flags


def _host_budget_missing(flags) -> bool:
    """Host memory and a file tier in --offload-tiers, and no --offload-host-cache-gb."""
    names = [f.split("=", 1)[0] for f in flags]
    if HOST_CACHE_FLAG in names or "--offload-tiers" not in names:
        return False
    i = names.index("--offload-tiers")
    value = flags[i].split("=", 1)[1] if "=" in flags[i] else (flags[i + 1] if i + 1 < len(flags) else "")
    tiers = value.split(",")
    return HOST_TIER in tiers and any(kind_of(t).needs_path for t in tiers)


def _flag_value(flags, name: str):
    """The value ``flags`` give ``name`` (``--name value`` or ``--name=value``; the last one wins), or None."""
    value = None
    for i, flag in enumerate(flags):
        if flag == name and i + 1 < len(flags):
            value = flags[i + 1]
        elif flag.startswith(name + "="):
            value = flag.split("=", 1)[1]
    return value


def pretrain_args(flags, machine):
    """pretrain_gpt.py's own parser; flags that do not change the plan are filled in if missing."""
    from megatron.training.args.arguments import parse_args

    flags = list(flags)
    if "--mock-data" not in flags and "--data-path" not in flags:
        flags.append("--mock-data")
    if "--train-iters" not in flags and "--train-samples" not in flags:
        flags += ["--train-iters", "1"]
    if "--lr" not in flags:
        flags += ["--lr", "1e-4"]
    gpu_job = _flag_value(flags, "--device") != "cpu"
    # A GPU job's defaults where the flags leave them to the machine (this one may have no GPU): pretrain_gpt.py
    # resolves them on the node that trains.
    if _flag_value(flags, "--offload-adam-kernel") is None:
        flags += ["--offload-adam-kernel", "fused"]
    if gpu_job and _flag_value(flags, "--offload-tiers") and _flag_value(flags, "--offload-update") is None:
        flags += ["--offload-update", "auto"]
    suggest_budget = _host_budget_missing(flags)
    if suggest_budget:  # the training refuses host + file tiers without a budget: plan_for suggests one
        flags += [HOST_CACHE_FLAG, "1"]
    args = parse_args(flags)
    if suggest_budget:
        args.offload_host_cache_gb = None
    tp, pp = args.tensor_model_parallel_size, args.pipeline_model_parallel_size
    if machine.world % (tp * pp):
        raise UserError(f"--nnodes {machine.nnodes} x --gpus-per-node {machine.gpus_per_node} = {machine.world} "
                        f"GPUs is not a multiple of TP {tp} x PP {pp}")
    from megatron.training.args.moe import check_world

    check_world(args, machine.world)  # the expert grid: ETP x EP x PP divides the world
    dp = machine.world // (tp * pp)
    if args.global_batch_size is None:
        args.global_batch_size = args.micro_batch_size * dp
    if args.global_batch_size % (args.micro_batch_size * dp):
        raise UserError(f"--global-batch-size {args.global_batch_size}: not a multiple of --micro-batch-size "
                        f"{args.micro_batch_size} x data-parallel size {dp}")
    return args


def _host_memory_bytes(given_gb):
    if given_gb is not None:
        return int(given_gb * GiB)
    from mlp_offload import meminfo_bytes as _meminfo_bytes

    return _meminfo_bytes("MemTotal") or 0


def tier_rates_and_capacities(config, capacities, nnodes):
    """Given rates and capacities, or measured on this node's paths (as the engine would)."""
    from mlp_offload import probe_tier as _probe
    from mlp_offload import HostMemory

    rates, space = {}, {}
    for name in config.file_tiers:
        rate = config.bandwidths.get(name)
        if rate is None:
            if not os.path.isdir(config.paths[name]):
                raise UserError(f"--offload-{name}-path {config.paths[name]}: not a directory here; give "
                                f"--offload-bandwidths {name}=READ:WRITE and --offload-{name}-capacity-gb to plan "
                                "without it")
            host = HostMemory(None, pin=False)
            try:
                rate = _probe(config, name, host)
            finally:
                host.close()
        if name in capacities:
            space[name] = capacities[name]
        elif os.path.isdir(config.paths[name]):
            stat = os.statvfs(config.paths[name])
            space[name] = stat.f_bavail * stat.f_frsize
        else:
            raise UserError(f"--offload-{name}-capacity-gb: needed to plan tier {name!r} (its path "
                            f"{config.paths[name]} is not here)")
        if config.token_scope.get(name) == "job":  # one file system for all nodes: each node gets its share
            from mlp_offload import TierBandwidth

            rate = TierBandwidth(rate.read_bps / nnodes, rate.write_bps / nnodes,
                                 None if rate.mixed_bps is None else rate.mixed_bps / nnodes)
            space[name] //= nnodes
        rates[name] = rate
    return rates, space


def cpu_rates(opts, config, gpu_job: bool):
    """(CPU Adam, conversion) elements/s of one rank: given, else for a GPU job the GPU node's defaults
    (this machine may be a login node), else measured here."""
    if gpu_job:
        return ((opts.adam_gelems or GPU_NODE_CPU_ADAM_GELEMS) * 1e9,
                (opts.convert_gelems or GPU_NODE_CONVERT_GELEMS) * 1e9)
    if opts.adam_gelems is not None and opts.convert_gelems is not None:
        return opts.adam_gelems * 1e9, opts.convert_gelems * 1e9
    from mlp_offload import measure_adam_rate, measure_convert_rate
    from mlp_offload import AdamKernel

    size = min(config.subgroup_size, 1 << 24)
    adam = AdamKernel(config.adam_kernel)
    adam_rate = opts.adam_gelems * 1e9 if opts.adam_gelems else measure_adam_rate(
        lambda p, g, m, v, step: adam(p, g, m, v, step=step), numel=size)
    convert_rate = opts.convert_gelems * 1e9 if opts.convert_gelems else measure_convert_rate(size)
    return adam_rate, convert_rate


def moved_bytes(stored) -> float:
    """Bytes the device's one-pass kernel moves per element of state in HBM, on the model's buffers: the bf16
    grad read; the stored master read and written, and its bf16 param (a remainders master's high half) read
    and written, or only written; both moments read and written. ``stored``: the formats' tags."""
    master, m, v = codecs_for(stored)
    param = 4 if master.needs_high else 2
    return 2 + 2 * master.bytes_per_param + param + 2 * (m.bytes_per_param + v.bytes_per_param)


def default_resident_gelems(stored) -> float:
    """``DEFAULT_GPU_ADAM_GELEMS`` (measured at 18 bytes an element) at ``stored``'s bytes; 8-bit moments:
    ``DEFAULT_GPU_ADAM_8BIT_GELEMS``."""
    if any(c.block for c in codecs_for(stored)):
        return DEFAULT_GPU_ADAM_8BIT_GELEMS
    return DEFAULT_GPU_ADAM_GELEMS * moved_bytes(("rem16", "bf16", "bf16")) / moved_bytes(stored)


def device_rates(opts, stored=("rem16", "bf16", "bf16")):
    from megatron.training.offload.plan_types import DeviceRates

    g = lambda x: None if x is None else x * 1e9  # noqa: E731
    resident = opts.gpu_adam_gelems or default_resident_gelems(stored)
    return DeviceRates(resident * 1e9, opts.gpu_link_gbps * 1e9, opts.node_host_gbps * 1e9,
                       g(opts.gpu_streamed_gelems), g(opts.cpu_beside_gelems), g(opts.gpu_streamed_beside_gelems))


def parse(argv):
    """The machine's options, the file tiers' capacities, and pretrain_gpt.py's flags."""
    opts, rest = machine_parser().parse_known_args(argv)
    for flag, value in (("--nnodes", opts.nnodes), ("--gpus-per-node", opts.gpus_per_node)):
        if value < 1:
            raise UserError(f"argument {flag}: must be a positive integer, got {value}")
    for flag, value in (("--gpu-memory-gb", opts.gpu_memory_gb), ("--gpu-tflops", opts.gpu_tflops),
                        ("--adam-gelems", opts.adam_gelems), ("--convert-gelems", opts.convert_gelems),
                        ("--host-memory-gb", opts.host_memory_gb),
                        *((f, getattr(opts, f[2:].replace("-", "_"))) for f, _, _ in DEVICE_FLAGS)):
        if value is not None and not 0 < value < float("inf"):
            raise UserError(f"argument {flag}: must be a positive number, got {value}")
    if opts.layouts is not None and not opts.recommend:
        raise UserError(f"argument --layouts {opts.layouts}: needs --recommend (it lists the candidates to plan)")
    opts.layouts = parse_layouts(opts.layouts)
    capacities, flags = split_capacities(rest)
    if opts.hf_config:
        flags = hf_model_flags(opts.hf_config) + flags  # argparse keeps the last: the user's win
    return opts, capacities, flags


def hf_model_flags(path: str):
    """The model flags of a Hugging Face config.json (the file or its directory)."""
    from megatron.training.hf import families

    directory = path if os.path.isdir(path) else os.path.dirname(path) or "."
    if not os.path.isdir(path) and os.path.basename(path) != "config.json":
        raise UserError(f"argument --hf-config {path}: expected a config.json or the directory holding one")
    cfg = families.read_config(directory)
    # Planning tokenizes nothing: a tokenizer of exactly the config's vocabulary (NullTokenizer adds
    # its end-of-document token to --vocab-size) keeps --padded-vocab-size's check satisfied.
    return [*families.model_flags(cfg), "--tokenizer-type", "NullTokenizer", "--vocab-size", str(cfg["vocab_size"] - 1)]


def measured_tflops(args) -> float:
    """--gpu-tflops where it is not given: the H200's figure for the experts' kernel (an MoE model) or the
    attention kernel the flags run. Each was measured with full recompute (Megatron-LM counts the model's
    FLOPs, not the recompute's): for the flags' own recompute it is scaled by the device work each does
    (selective: 4/3 of it), as --recommend scales a figure measured with the flags as given."""
    from megatron.training.offload.plan_candidates import recompute_work

    if getattr(args, "num_experts", None):
        figure = MEASURED_H200_TFLOPS["sequential_experts"]
    else:
        figure = MEASURED_H200_TFLOPS["unfused" if getattr(args, "core_attention", "sdpa") == "unfused" else "sdpa"]
    from megatron.training.model.uneven_pipeline import stage_layers

    own = recompute_work(args.recompute_granularity, args.recompute_method, args.recompute_num_layers,
                         max(stage_layers(args)))
    return figure * (recompute_work("full") / own)


def parse_layouts(text):
    """--layouts: 'auto', or a comma list of TPxPP as (TP, PP) pairs."""
    if text in (None, "auto"):
        return text
    try:
        pairs = [tuple(int(n) for n in item.split("x")) for item in text.split(",")]
        assert all(len(pair) == 2 and min(pair) >= 1 for pair in pairs)
    except (ValueError, AssertionError):
        raise UserError(f"argument --layouts: expected 'auto' or a comma list of TPxPP (e.g. 4x1,2x2), "
                        f"got {text!r}") from None
    return pairs


def layouts_to_try(opts, args, machine):
    """--layouts as (TP, PP) pairs; [None] (the layout as given) without it."""
    from megatron.training.offload.plan_candidates import layouts

    if opts.layouts == "auto":
        return layouts(machine.world, machine.gpus_per_node, args.num_layers)
    return opts.layouts or [None]


def plan_for(opts, capacities, flags, measured, gpu_tflops=None, batch_sizes=None):
    """One plan. ``measured`` keeps the tiers' and the CPU's rates of a first call for the next ones
    (they do not change with the flags a recommendation varies); ``gpu_tflops`` replaces --gpu-tflops."""
    from megatron.training.offload.capacity_plan import host_beside_state, make_plan, suggested_host_cache_gb
    from megatron.training.offload.plan_types import Machine
    from megatron.training.data.datasets import build_tokenizer, padded_vocab_size
    from megatron.training.offload.flags import config_from_args
    from megatron.training.model.configs import transformer_config

    machine = Machine(opts.nnodes, opts.gpus_per_node, int(opts.gpu_memory_gb * GiB),
                      _host_memory_bytes(opts.host_memory_gb), gpu_tflops or opts.gpu_tflops or 0.0)
    args = pretrain_args(flags, machine)
    machine.gpu_tflops = machine.gpu_tflops or measured_tflops(args)
    args.padded_vocab_size = padded_vocab_size(args, build_tokenizer(args))
    cfg = transformer_config(args)
    config, rates, space, adam_rate, convert_rate, cache_gb = None, {}, {}, 0.0, 0.0, None
    suggested = False
    if args.offload_tiers:
        unknown = sorted(set(capacities) - set(args.offload_tiers))
        if unknown:
            raise UserError(f"argument --offload-{unknown[0]}-capacity-gb: {unknown[0]!r} is not one of "
                            f"--offload-tiers {','.join(args.offload_tiers)}")
        cache_gb = args.offload_host_cache_gb
        suggested = cache_gb is None and HOST_TIER in args.offload_tiers and len(args.offload_tiers) > 1
        if suggested:
            cache_gb = suggested_host_cache_gb(machine, machine.gpus_per_node, args.offload_subgroup_size)
            args.offload_host_cache_gb = cache_gb
        config = config_from_args(args, rank=0)
        if "tiers" not in measured:
            measured["tiers"] = tier_rates_and_capacities(config, capacities, machine.nnodes)
            measured["cpu"] = cpu_rates(opts, config, gpu_job=args.device != "cpu")
        rates, space = measured["tiers"]
        adam_rate, convert_rate = measured["cpu"]
    if args.device != "cpu":  # a GPU job: the engine may update on the device
        machine.device_rates = device_rates(opts, *([config.stored_dtypes] if config is not None else []))
    plan = make_plan(args, cfg, machine, config, MeasuredRates(rates, adam_rate, convert_rate), space,
                     batch_sizes or table_batch_sizes(opts, args, machine))
    beside = host_beside_state(plan)
    if suggested and beside:  # the suggestion again, beside what else the plan put in host memory
        cache_gb = suggested_host_cache_gb(machine, machine.gpus_per_node, args.offload_subgroup_size, beside)
        args.offload_host_cache_gb = cache_gb
        config = config_from_args(args, rank=0)
        plan = make_plan(args, cfg, machine, config, MeasuredRates(rates, adam_rate, convert_rate), space,
                         batch_sizes or table_batch_sizes(opts, args, machine))
    plan.host_cache_gb = cache_gb
    plan.tier_rates = rates
    plan.tflops_given = bool(gpu_tflops or opts.gpu_tflops)  # else the H200's figure for its attention
    plan.cpu_rates_line = cpu_rates_line(opts, args, adam_rate, convert_rate, machine) if config is not None else ""
    return plan, args, machine


def table_batch_sizes(opts, args, machine):
    """The tokens/s table's global batch sizes: --global-batch-sizes, else the run's and 2x, 4x, 8x it."""
    dp = machine.world // (args.tensor_model_parallel_size * args.pipeline_model_parallel_size)
    if not opts.global_batch_sizes:
        return [args.global_batch_size * k for k in (1, 2, 4, 8)]
    try:
        sizes = [int(x) for x in opts.global_batch_sizes.split(",")]
    except ValueError:
        raise UserError(f"argument --global-batch-sizes: expected integers, got {opts.global_batch_sizes!r}") from None
    step = args.micro_batch_size * dp
    bad = [g for g in sizes if g <= 0 or g % step]
    if bad:
        raise UserError(f"argument --global-batch-sizes: {bad[0]} is not a positive multiple of micro-batch "
                        f"{args.micro_batch_size} x data-parallel size {dp}")
    return sizes


def suggested_flags(plan, args, flags):
    """The user's flags, with the host budget the plan used where they gave none."""
    out = list(flags)
    if plan.host_cache_gb is not None and HOST_CACHE_FLAG not in out:
        out += [HOST_CACHE_FLAG, f"{plan.host_cache_gb:g}"]
    return out


def cpu_rates_line(opts, args, adam_rate, convert_rate, machine) -> str:
    """The update rates a plan assumed, and where each came from."""
    def source(flag, given):
        if given is not None:
            return f"{flag}"
        return "the GPU node's default" if args.device != "cpu" else "measured on this machine"
    text = (f"update rates per rank: CPU Adam {adam_rate / 1e9:.2f} G elements/s ({source('--adam-gelems', opts.adam_gelems)}), "
            f"conversion {convert_rate / 1e9:.2f} ({source('--convert-gelems', opts.convert_gelems)})")
    d = machine.device_rates
    if d is not None:
        text += (f"; device resident {d.resident_elems_per_s / 1e9:.0f} G elements/s "
                 f"({'--gpu-adam-gelems' if opts.gpu_adam_gelems else 'default'}), host link "
                 f"{d.link_bps / 1e9:.0f} GB/s ({'default' if opts.gpu_link_gbps == DEFAULT_GPU_LINK_GBPS else '--gpu-link-gbps'})")
    return text


def describe(plan, args, machine, flags, rates) -> str:
    g = lambda b: f"{b / GiB:.1f} GiB"  # noqa: E731
    tp, pp = args.tensor_model_parallel_size, args.pipeline_model_parallel_size
    lines = [f"{'FITS' if plan.fits else 'DOES NOT FIT'}: {plan.params_total / 1e9:.3f} G parameters on "
             f"{machine.nnodes} node(s) x {machine.gpus_per_node} GPU(s) (TP {tp}, PP {pp}, "
             f"DP {machine.world // (tp * pp)})"]
    if args.num_experts is not None:
        ep, etp = args.expert_model_parallel_size, args.expert_tensor_parallel_size
        lines.append(f"mixture of experts: {args.num_experts} experts, top-{args.moe_router_topk}; "
                     f"{plan.params_active / 1e9:.3f} G parameters active per token; EP {ep}, ETP {etp}, "
                     f"expert-DP {machine.world // (ep * etp * pp)}")
    lines += [f"  problem: {p}" for p in plan.problems]
    lines.append(f"GPU memory per rank ({g(machine.gpu_memory_bytes)}): "
                 + ", ".join(f"{k} {g(v)}" for k, v in plan.gpu_bytes.items())
                 + f" = {g(sum(plan.gpu_bytes.values()))} (activations estimated)")
    for kind, e in plan.engines.items():
        numel = plan.shard_numels[kind]
        label = "" if len(plan.engines) == 1 else f" ({kind})"
        lines.append(f"optimizer state per rank{label}: {numel} elements, {g(e.state_bytes)} in "
                     f"{len(e.subgroups)} subgroups ({e.state_bytes / numel:.1f} B/param); "
                     f"placement {plan.placement_counts(kind)}")
    if plan.engines:
        lines.append(f"host memory per node ({g(machine.host_memory_bytes)}): "
                     + ", ".join(f"{k} {g(v)}" for k, v in plan.host_bytes_per_node.items()))
        for tier, nbytes in plan.tier_bytes_per_node.items():
            r = rates[tier]
            engines = plan.engines.values()
            read = sum(e.prediction.read_bytes.get(tier, 0) for e in engines)
            written = sum(e.prediction.write_bytes.get(tier, 0) for e in engines)
            tokens = next(iter(engines)).tokens_per_tier[tier]
            lines.append(f"{tier} per node: {g(nbytes)} stored; per rank and step {read / 1e9:.2f} GB read, "
                         f"{written / 1e9:.2f} GB written at r {r.read_bps / 1e9:.2f} w {r.write_bps / 1e9:.2f} GB/s, "
                         f"{tokens} I/O token(s)" + _daily_writes(written * machine.gpus_per_node, plan.iteration_s))
        for kind, e in plan.engines.items():
            lines.append(e.prediction.describe() + ("" if len(plan.engines) == 1 else f" [{kind}]"))
        if getattr(plan, "cpu_rates_line", ""):
            lines.append(plan.cpu_rates_line)
    copies = plan.param_copies_s
    update, joins = (f" + update {plan.update_s:.3f} s" + (f" (of it {copies:.3f} s the copies across the host link "
                                                           f"add: the params, and grads in host memory)" if copies else "")
                     if plan.update_s is not None else ""), "="
    if plan.overlaps_forward and plan.update_s is not None:  # not a sum (mlp_offload.predict_iteration)
        update, joins = f" and update {plan.update_s:.3f} s, its device share under the next forward", "from"
    tflops_source = "" if plan.tflops_given else (", one H200's with these kernels: --gpu-tflops from "
                                                  "a short run of yours is better")
    lines.append(f"predicted iteration {plan.iteration_s:.3f} s {joins} compute {plan.compute_s:.3f} s "
                 f"(at {machine.gpu_tflops:g} TFLOP/s per GPU{tflops_source}){update}; bottleneck: {plan.bottleneck}")
    if plan.checkpoint_bytes:
        saved = plan.checkpoint_bytes
        lines.append(f"a checkpoint: about {sum(saved.values()) / 1e9:.1f} GB per save ("
                     + ", ".join(f"{part} {nbytes / 1e9:.1f} GB" for part, nbytes in saved.items())
                     + f"), {sum(saved.values()) / machine.nnodes / 1e9:.1f} GB per node; --save needs room for the "
                     f"checkpoints kept and one more being written{describe_checkpoints_at_once(args, saved)}")
    lines.append("tokens/s by global batch size: "
                 + ", ".join(f"{gbs}: {tps:,.0f}" for gbs, tps in plan.tokens_per_s.items()))
    lines.append("flags: " + shlex.join(suggested_flags(plan, args, flags)))
    return "\n".join(lines)


def checkpoints_at_once(args) -> int:
    """The most of a fresh run's checkpoints on --save at once, one being written included (its saves every
    --save-interval to --train-iters and at the end, kept as --save-retain-interval keeps them); 0 without
    --save-interval."""
    saves = planned_saves(0, args.save_interval, args.train_iters) if args.save_interval else []
    return max(checkpoints_on_disk(saves, getattr(args, "save_retain_interval", None)), default=0)


def describe_checkpoints_at_once(args, saved) -> str:
    at_once = checkpoints_at_once(args)
    if not at_once:
        return ""
    retention = (f"those at multiples of --save-retain-interval {args.save_retain_interval} and the newest kept"
                 if getattr(args, "save_retain_interval", None) else "every one kept")
    return (f": with --save-interval {args.save_interval} to --train-iters {args.train_iters} ({retention}), up to "
            f"{at_once} at once, about {at_once * sum(saved.values()) / 1e9:.1f} GB")


def recommend(opts, capacities, flags, args, machine, measured):
    """Every candidate configuration (``plan_candidates``) for the run's global batch size, planned,
    and the fastest that fits. Compute is scaled from --gpu-tflops, which the user measured with their
    own recompute setting, by the device work each candidate's recompute does; the micro-batch size
    is taken not to change the TFLOP/s."""
    from megatron.training.model.uneven_pipeline import stage_layers
    from megatron.training.offload.plan_candidates import (AS_GIVEN, candidate_flags, candidates, in_host_of,
                                                           own_flags, recompute_work)

    pp = args.pipeline_model_parallel_size
    dp = machine.world // (args.tensor_model_parallel_size * pp)
    own = recompute_work(args.recompute_granularity, args.recompute_method, args.recompute_num_layers,
                         max(stage_layers(args)))
    tiers = args.offload_tiers or []
    given_layout = (args.tensor_model_parallel_size, pp)
    given = (args.recompute_granularity or "none", args.micro_batch_size,
             "none" if GPU_TIER not in tiers else getattr(args, "offload_gpu_cache_gb", None))
    rows, grid = [], []
    for layout in layouts_to_try(opts, args, machine):
        share = dp if layout is None else machine.world // (layout[0] * layout[1])
        if args.global_batch_size % share == 0:  # else the layout's data-parallel size does not divide the batch
            grid += candidates(args.global_batch_size // share, args.offload_tiers, args.device != "cpu", layout)
    for c in grid:
        cand_flags = candidate_flags(flags, args.offload_tiers, c, args.global_batch_size)
        tflops = (opts.gpu_tflops or measured_tflops(args)) * own / recompute_work(c.recompute)
        try:
            plan, _, _ = plan_for(opts, capacities, cand_flags, measured, tflops, [args.global_batch_size])
        except UserError as err:  # a combination the training would refuse: not a candidate
            rows.append({"candidate": c.describe(), "fits": False, "problems": [str(err)]})
            continue
        changed = ((c.recompute != given[0]) + (c.micro_batch_size != given[1])
                   + (c.gpu_tier not in (AS_GIVEN, given[2])) + (c.layout not in (None, given_layout))
                   + (c.in_host != in_host_of(args)))
        rows.append({"candidate": c.describe(), "changes": own_flags(c, args.offload_tiers), "changed": changed,
                     "fits": plan.fits, "problems": plan.problems,
                     "predicted_iteration_s": plan.iteration_s, "tokens_per_s": plan.tokens_per_s[args.global_batch_size],
                     "gpu_tflops": tflops, "flags": suggested_flags(plan, args, cand_flags)})
    fitting = [r for r in rows if r["fits"]]
    # Ties go to the candidate closest to the flags as given.
    chosen = max(fitting, key=lambda r: (r["tokens_per_s"], -r["changed"])) if fitting else None
    return {"global_batch_size": args.global_batch_size, "candidates": rows, "chosen": chosen}


def describe_recommendation(advice, own_tokens_per_s) -> str:
    lines = [f"candidates for global batch size {advice['global_batch_size']} (tokens/s):"]
    for r in advice["candidates"]:
        result = (f"{r['tokens_per_s']:,.0f} (iteration {r['predicted_iteration_s']:.3f} s)" if r["fits"]
                  else "DOES NOT FIT: " + "; ".join(r["problems"])[:160])
        lines.append(f"  {r['candidate']}: {result}")
    chosen = advice["chosen"]
    if chosen is None:
        lines.append("recommended: none of them fits")
    else:
        mine = "does not fit" if own_tokens_per_s is None else f"{own_tokens_per_s:,.0f} tokens/s"
        lines.append(f"recommended: {chosen['candidate']}: {chosen['tokens_per_s']:,.0f} tokens/s (as given: {mine})")
        lines.append("recommended flags: " + shlex.join(chosen["flags"]))
    return "\n".join(lines)


# The start-up probes of the GPU machines' disks recorded in docs/results read at 0.65-1.42x their median (27 runs,
# tests/unit/test_plan_replay.py): 70.7 B planned at 34.7 s with one machine kind's usual rates ran 42.9 s on a disk
# that probed at 0.66x of them. A disk-bound plan prints the iteration at these factors of the bounding tier's rates.
DISK_RATE_FACTORS = (0.64, 1.45)


def bounding_file_tier(plan):
    """The file tier whose I/O bounds the plan (its bottleneck reads "nvme I/O"), else None."""
    tier = plan.bottleneck[:-len(" I/O")] if plan.bottleneck.endswith(" I/O") else None
    return tier if tier in plan.tier_rates else None


def disk_bound_range(opts, capacities, flags, measured, plan):
    """Where a file tier bounds the plan: the iteration at that tier's rates scaled by each factor, so that
    a figure priced on one probe of a disk comes with what a slower or faster day gives. Empty otherwise."""
    tier = bounding_file_tier(plan)
    if not plan.fits or tier is None:
        return {}
    rates, space = measured["tiers"]
    out = {}
    for factor in DISK_RATE_FACTORS:
        r = rates[tier]
        scaled = dataclasses.replace(r, **{k: getattr(r, k) * factor for k in
                                           ("read_bps", "write_bps", "mixed_bps", "shared_mixed_bps")
                                           if getattr(r, k) is not None})
        other, _, _ = plan_for(opts, capacities, flags, {"tiers": ({**rates, tier: scaled}, space),
                                                         "cpu": measured["cpu"]})
        out[factor] = other.iteration_s
    return out


def describe_disk_range(tier: str, iterations) -> str:
    return (f"{tier} bounds this plan, and a disk's speed moves from probe to probe (0.65-1.42x on the GPU machines "
            "measured): "
            + ", ".join(f"at {f:g}x {tier}'s rates {s:.3f} s an iteration" for f, s in iterations.items()))


class OncePerMessage(logging.Filter):
    """A recommendation plans dozens of candidates through the engine's placement, which warns about each one
    (e.g. a shallow prefetch): each distinct warning is printed once per planning."""

    def __init__(self):
        super().__init__()
        self.seen = set()

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        if message in self.seen:
            return False
        self.seen.add(message)
        return True


ENGINE_LOG_ONCE = OncePerMessage()


def assumed_machine(opts, machine) -> str:
    """A line naming the machine sizes the plan assumed rather than was given (the GPU's default, this
    machine's host memory: on a login node neither is the GPU node's), or ""."""
    assumed = []
    if opts.gpu_memory_gb == GPU_MEMORY_DEFAULT_GB:
        assumed.append(f"GPU memory {opts.gpu_memory_gb:g} GiB (the default; --gpu-memory-gb gives the GPUs')")
    if opts.host_memory_gb is None:
        assumed.append(f"host memory {machine.host_memory_bytes / GiB:.1f} GiB per node (this machine's; "
                       "--host-memory-gb gives the GPU nodes')")
    return "assumed: " + "; ".join(assumed) if assumed else ""


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    ENGINE_LOG_ONCE.seen.clear()
    logging.getLogger("mlp_offload").addFilter(ENGINE_LOG_ONCE)
    with reported_once():
        opts, capacities, flags = parse(argv)
        measured = {}
        plan, args, machine = plan_for(opts, capacities, flags, measured)
        gpu_short = any(p.startswith("GPU memory") for p in plan.problems)
        advice = recommend(opts, capacities, flags, args, machine, measured) if opts.recommend or gpu_short else None
        if gpu_short and advice["chosen"]:  # DOES NOT FIT names the flags of the fastest plan that fits
            chosen = advice["chosen"]
            plan.problems.append(f"fits with {shlex.join(chosen['changes'])}: {chosen['tokens_per_s']:,.0f} tokens/s "
                                 f"predicted ({chosen['candidate']}; --recommend lists every candidate)")
        advice = advice if opts.recommend else None
        own = plan.tokens_per_s.get(args.global_batch_size) if plan.fits else None
        disk_range = disk_bound_range(opts, capacities, flags, measured, plan)
        if opts.json:
            extra = {"recommendation": advice} if advice else {}
            extra["iteration_s_at_disk_rates"] = {f"{f:g}": v for f, v in disk_range.items()}
            extra["checkpoints_at_once"] = checkpoints_at_once(args)
            print(json.dumps({**plan.as_json(), "gpu_tflops": machine.gpu_tflops, "flags": suggested_flags(plan, args, flags),
                              **extra}, indent=1))
        else:
            print(describe(plan, args, machine, flags, plan.tier_rates))
            assumed = assumed_machine(opts, machine)
            if assumed:
                print(assumed)
            if disk_range:
                print(describe_disk_range(bounding_file_tier(plan), disk_range))
            if advice:
                print(describe_recommendation(advice, own))
    return 0 if plan.fits else 1


if __name__ == "__main__":
    sys.exit(main())
