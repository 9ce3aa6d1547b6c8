"""The optimizer-offload flags: this repo's engine (``--offload-*``, declared once in their table,
``offload/options.py``; the ``--offload-NAME-path DIR`` pairs taken from the unknown arguments here)
and megatron-core's own CPU offload passed through as a peer; their checks, and the defaults they
imply (the distributed optimizer, the engine's Adam kernel and update side). What a value means is
checked by the engine's own config, built from the flags at parse time so that a bad value fails
before any work, named by its flag."""

from __future__ import annotations

import re
from typing import List, Tuple

from megatron.training.args.unknown_flags import unknown_arguments_line
from megatron.training.errors import fraction
from megatron.training.offload.options import GPU_CACHE_FLAG, GPU_START_FLAG
from megatron.training.offload import options

_PATH_FLAG = re.compile(r"^--offload-([A-Za-z0-9_]+)-path(?:=(.*))?$")


def add_groups(parser) -> None:
    g = parser.add_argument_group("optimizer offload (see mlp_offload.config.OffloadConfig)")
    options.add_flags(g)

    # megatron-core's own CPU offload (HybridDeviceOptimizer), passed through as a peer to compare with.
    g = parser.add_argument_group("megatron-core CPU optimizer offload (OptimizerConfig pass-through)")
    g.add_argument("--optimizer-cpu-offload", action="store_true",
                   help="megatron-core's HybridDeviceOptimizer: Adam state and step on the CPU (CUDA only)")
    g.add_argument("--optimizer-offload-fraction", type=fraction, default=1.0,
                   help="fraction of the optimizer state megatron-core keeps on the CPU (default 1.0)")
    g.add_argument("--overlap-cpu-optimizer-d2h-h2d", action="store_true",
                   help="overlap megatron-core's CPU Adam with its grad D2H / param H2D copies")


def take_named_flags(rest: List[str], pattern, what: str, error) -> Tuple[dict, List[str]]:
    """Take ``--offload-NAME-<kind> VALUE`` (or ``=VALUE``) pairs matching ``pattern`` (group 1: the
    name, group 2: an ``=VALUE``) out of ``rest``: ({name: value}, the other arguments). ``error(line)``
    ends parsing; ``what`` names the value in its lines."""
    found, leftover, i = {}, [], 0
    while i < len(rest):
        match = pattern.match(rest[i])
        if not match:
            leftover.append(rest[i])
            i += 1
            continue
        flag, value = rest[i].split("=", 1)[0], match.group(2)
        if value is None:
            if i + 1 >= len(rest) or rest[i + 1].startswith("--"):
                error(f"argument {flag}: expected one argument ({what})")
            value, i = rest[i + 1], i + 2
        else:
            i += 1
        if not value:
            error(f"argument {flag}: {what} must not be empty")
        if match.group(1) in found:
            error(f"argument {flag}: given twice")
        found[match.group(1)] = value
    return found, leftover


def parse_offload_paths(parser, rest: List[str]) -> dict:
    """Take ``--offload-XXX-path DIR`` (or ``=DIR``) pairs out of the unknown arguments; any other stops in one
    line (with what each unknown flag most likely is)."""
    paths, leftover = take_named_flags(rest, _PATH_FLAG, "a directory", parser.error)
    if leftover:
        known = [s for action in parser._actions for s in action.option_strings]
        parser.error(unknown_arguments_line(leftover, known))
    return paths


def validate(parser, args) -> None:
    _validate_engine_flags(parser, args)
    _validate_mcore_offload(parser, args)


def _validate_engine_flags(parser, args) -> None:
    """Offload flags need --offload-tiers; what they say is checked by the engine's own config,
    built here once so that a bad value fails before any work, named by its flag."""
    if args.offload_tiers is None:
        given = options.given_without_tiers(args)
        if given:
            parser.error(f"argument {given}: requires --offload-tiers")
        return
    if args.offload_gpu_start_gb is not None and args.offload_gpu_cache_gb != "auto":
        parser.error(f"argument {GPU_START_FLAG}: sizes an auto gpu tier; it needs {GPU_CACHE_FLAG} "
                     f"auto (given: {args.offload_gpu_cache_gb})")
    if args.offload_adam_kernel is None:
        args.offload_adam_kernel = default_adam_kernel(on_cpu=_on_cpu(args))
    if args.offload_update is None:
        args.offload_update = "cpu" if _on_cpu(args) else "auto"
    from mlp_offload import OffloadConfigError
    from megatron.training.offload.flags import config_from_args

    try:
        config_from_args(args, rank=0)  # the engine's checks, the one place its rules live
    except OffloadConfigError as err:
        parser.error(options.in_flags(str(err)))


def _validate_mcore_offload(parser, args) -> None:
    """megatron-core's CPU offload is a separate optimizer: exclusive with ours, and CUDA-only."""
    if not args.optimizer_cpu_offload:
        for flag, given in (("--optimizer-offload-fraction", args.optimizer_offload_fraction != 1.0),
                            ("--overlap-cpu-optimizer-d2h-h2d", args.overlap_cpu_optimizer_d2h_h2d)):
            if given:
                parser.error(f"argument {flag}: requires --optimizer-cpu-offload")
        return
    if args.offload_tiers is not None:
        parser.error("argument --optimizer-cpu-offload: not allowed with --offload-tiers (two different "
                     "optimizer offloads: megatron-core's HybridDeviceOptimizer or this repo's engine)")
    if not args.use_distributed_optimizer:
        parser.error("argument --optimizer-cpu-offload: not allowed with --no-use-distributed-optimizer "
                     "(megatron-core's CPU offload shards the optimizer state)")
    if _on_cpu(args):
        parser.error("argument --optimizer-cpu-offload: needs a CUDA device (megatron-core's "
                     "HybridDeviceOptimizer cannot run with --device cpu); use --offload-tiers host instead")


def default_distributed_optimizer(parser, args) -> None:
    """Off by default, as in Megatron-LM; an optimizer offload shards the optimizer state, so it
    implies the distributed optimizer (which a user can only refuse explicitly: an error then)."""
    offload = args.offload_tiers is not None or args.optimizer_cpu_offload
    if args.use_distributed_optimizer is None:
        args.use_distributed_optimizer = offload
    elif not args.use_distributed_optimizer and args.offload_tiers is not None:
        parser.error("argument --offload-tiers: not allowed with --no-use-distributed-optimizer "
                     "(the offload engine holds the distributed optimizer's shards)")


def default_adam_kernel(on_cpu: bool) -> str:
    """The engine's AdamW kernel unless --offload-adam-kernel names one.

    On a CPU device megatron-core's distributed optimizer (no apex/TE there) steps torch.optim.AdamW,
    whose default on CPU tensors is its single-tensor kernel; the fused CPU kernel rounds the param
    update differently (an ulp on about 2% of the elements each step), which the bf16 params
    show a few iterations later. So 'single' there: the same numbers as megatron-core. On a GPU
    megatron-core's optimizer runs on the GPU, which no CPU kernel reproduces: 'fused', the fastest."""
    return "single" if on_cpu else "fused"


def _on_cpu(args) -> bool:
    """Whether the model will live on the CPU (initialize.select_device's choice)."""
    return args.device == "cpu" or args.device == "auto" and not _cuda_available()


def _cuda_available() -> bool:
    import torch  # only when the flag is given: parsing stays light otherwise

    return torch.cuda.is_available()
