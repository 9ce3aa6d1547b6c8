"""The optimizer-offload flags: this repo's engine (``--offload-*``, their ``--offload-XXX-path DIR``
pairs) and megatron-core's own CPU offload passed through as a peer; their checks, and the defaults
they imply (the distributed optimizer, the engine's Adam kernel). What a value means is checked by
the engine's own config (``offload/flags.py``: ``config_from_args``), built once here so a bad value fails
before any work, named by its flag."""

from __future__ import annotations

import argparse
import re
from typing import List, Tuple

from megatron.training.errors import (GPU_CACHE_FLAG, GPU_MARGIN_FLAG, GPU_START_FLAG, HOST_CACHE_FLAG,
                                      UPDATE_ON_OF_FLAG, fraction, non_negative_float, non_negative_int,
                                      positive_int)
from mlp_offload import GPU_TIER


def cpu_share(text: str):
    """--offload-cpu-share: a whole number of subgroups >= 0, or auto (the time model's choice)."""
    return "auto" if text == "auto" else non_negative_int(text)

_PATH_FLAG = re.compile(r"^--offload-([A-Za-z0-9_]+)-path(?:=(.*))?$")


def _tier_list(text: str) -> List[str]:
    tiers = [t.strip() for t in text.split(",") if t.strip()]
    if not tiers:
        raise argparse.ArgumentTypeError("expected a comma-separated list of tier names, e.g. host,nvme")
    for name in tiers:
        if not re.fullmatch(r"[A-Za-z0-9_]+", name):
            raise argparse.ArgumentTypeError(f"tier name {name!r} must be alphanumeric")
    if len(set(tiers)) != len(tiers):
        raise argparse.ArgumentTypeError(f"{text!r} names a tier twice")
    return tiers


def _token_scopes(text: str) -> dict:
    scopes = {}
    for item in text.split(","):
        match = re.fullmatch(r"\s*([A-Za-z0-9_]+)\s*=\s*(node|job)\s*", item)
        if not match:
            raise argparse.ArgumentTypeError(f"{item!r}: expected TIER=node or TIER=job, e.g. pfs=job")
        scopes[match.group(1)] = match.group(2)
    return scopes


def _bandwidths(text: str) -> str:
    for item in text.split(","):
        if not re.fullmatch(r"\s*[A-Za-z0-9_]+\s*=\s*[0-9.eE+-]+\s*:\s*[0-9.eE+-]+\s*(:\s*[0-9.eE+-]+\s*)?", item):
            raise argparse.ArgumentTypeError(
                f"{item!r}: expected TIER=READ_GBPS:WRITE_GBPS[:MIXED_GBPS], e.g. nvme=3.0:2.8")
    return text


def _gpu_cache(text: str):
    """``auto`` or GiB (a non-negative number)."""
    if text.strip().lower() == "auto":
        return "auto"
    try:
        return non_negative_float(text)
    except argparse.ArgumentTypeError:
        raise argparse.ArgumentTypeError(f"expected GiB (a number >= 0) or 'auto', got {text!r}") from None


def add_groups(parser) -> None:
    g = parser.add_argument_group("optimizer offload (see mlp_offload.config.OffloadConfig)")
    g.add_argument("--offload-tiers", type=_tier_list, default=None,
                   help="comma list, e.g. host,nvme,pfs; default: no offload. "
                        "Each file tier XXX needs --offload-XXX-path DIR")
    g.add_argument(HOST_CACHE_FLAG, type=non_negative_float, default=None)
    g.add_argument(GPU_CACHE_FLAG, type=_gpu_cache, default=None, metavar="GB|auto",
                   help=f"with {GPU_TIER!r} in --offload-tiers: device memory for optimizer state, updated in place; "
                        f"'auto' learns the spare memory from the real peak after each iteration, keeps "
                        f"{GPU_MARGIN_FLAG} free and hands subgroups back to lower tiers if it shrinks")
    g.add_argument(GPU_START_FLAG, type=non_negative_float, default=None,
                   help=f"{GPU_CACHE_FLAG} auto: the gpu tier's size until the peak after iteration 1 is "
                        "measured (0: empty); default: half of what the activation estimate and the margin leave")
    g.add_argument(GPU_MARGIN_FLAG, type=non_negative_float, default=4.0,
                   help=f"{GPU_CACHE_FLAG} auto: device memory left free beside the peak")
    g.add_argument("--offload-update", choices=list(UPDATE_ON_OF_FLAG), default=None,
                   help="where subgroups held in host memory are updated: CPU Adam, the GPU (state streamed "
                        "host->GPU->host, copies overlapped) or auto (per subgroup from the measured rates, both "
                        "at once); default: auto on a GPU, cpu on a CPU device")
    g.add_argument("--offload-subgroup-size", type=positive_int, default=100_000_000)
    g.add_argument("--offload-prefetch-depth", type=positive_int, default=2)
    g.add_argument("--offload-tokens-per-tier", type=positive_int, default=None,
                   help="ranks of one node allowed to do I/O on a tier path at once; default: 1 where "
                        "the probe sees the device lose bandwidth with all ranks streaming, else all")
    g.add_argument("--offload-token-scope", type=_token_scopes, default={}, metavar="TIER=node|job,...",
                   help="who takes turns on a tier path: the ranks of each node (node, the default) or "
                        "all ranks of the job (job: for a shared file system that does not scale with nodes)")
    g.add_argument("--offload-io-block-mb", type=positive_int, default=8)
    g.add_argument("--offload-io-threads", type=positive_int, default=4)
    g.add_argument("--offload-bandwidths", type=_bandwidths, default=None)
    g.add_argument("--offload-adam-kernel", choices=["fused", "foreach", "single"], default=None,
                   help="default: on a CPU device 'single', the kernel megatron-core's torch.optim.AdamW "
                        "runs there (bit-identical to it); on a GPU 'fused', the fastest")
    g.add_argument("--offload-no-cache", action="store_true")
    g.add_argument("--offload-overlap-forward", action="store_true",
                   help="the next iteration's forward starts while the GPU still updates: each layer waits "
                        "only for its own params (above data-parallel size 1 with --overlap-param-gather: each "
                        "bucket's all-gather follows this rank's update of it)")
    g.add_argument("--offload-cpu-share", type=cpu_share, default=None, metavar="SUBGROUPS|auto",
                   help="with --offload-overlap-forward and --offload-update auto: how many of the subgroups held in "
                        "host memory the CPU updates in the step while the GPU updates the rest under the next "
                        "forward; default none (on an H200 a CPU share slowed the 20.68 B iteration by 5%%); auto: "
                        "where the time model predicts the update the iteration sees shorter")
    g.add_argument("--offload-read-ahead-gb", type=non_negative_float, default=0.0,
                   help="GPU memory for host-held state the GPU updates, copied in under the forward and backward "
                        "before its step while the host link idles (whole subgroups; 0: none)")
    g.add_argument("--offload-no-one-pass-update", action="store_true",
                   help="device updates widen, step and round back in separate passes (as before the one-pass kernel)")
    g.add_argument("--offload-no-update-in-model-buffers", action="store_true",
                   help="the device's one-pass update takes the grads as an fp32 copy and hands the params back as "
                        "a copy, instead of reading and writing them in the model's buffers")
    g.add_argument("--offload-no-interleave", action="store_true",
                   help="the GPU updates its subgroups held in memory in the schedule's order, the ones in HBM in a "
                        "run of their own, instead of spread between those streamed from host memory (an A/B of "
                        "the overlap of the HBM updates with the host link's copies)")
    g.add_argument("--offload-no-cpu-one-pass", action="store_true",
                   help="CPU updates widen, step and round back in separate passes (no run-time built C++ kernel)")
    g.add_argument("--offload-no-odirect", action="store_true")
    g.add_argument("--offload-no-checksums", action="store_true")
    g.add_argument("--offload-cpu-threads", type=positive_int, default=None)
    g.add_argument("--offload-save-staging-gb", type=non_negative_float, default=4.0,
                   help="--async-save: host memory per rank for copies of state the next update reaches first")
    g.add_argument("--offload-probe-mb", type=positive_int, default=1024,
                   help="size of the bandwidth probe per file tier (cached per path)")
    g.add_argument("--offload-telemetry-log", default=None, metavar="FILE",
                   help="per-step engine telemetry as JSON lines; '{rank}' in FILE is replaced by "
                        "the global rank, otherwise only rank 0 writes")
    g.add_argument("--offload-trace", default=None, metavar="FILE",
                   help="Chrome-trace JSON (Perfetto) of the engine's reads and writes per tier, waits, "
                        "gradients and Adam, written when training ends; '{rank}' in FILE gives one "
                        "file per rank, otherwise only rank 0 writes. Draw it with tools/plot_timeline.py")

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
    """Take ``--offload-XXX-path DIR`` (or ``=DIR``) pairs out of the unknown arguments."""
    paths, leftover = take_named_flags(rest, _PATH_FLAG, "a directory", parser.error)
    if leftover:
        parser.error(f"unrecognized arguments: {' '.join(leftover)}")
    return paths


def validate(parser, args) -> None:
    _validate_engine_flags(parser, args)
    _validate_mcore_offload(parser, args)


def _validate_engine_flags(parser, args) -> None:
    """Offload flags need --offload-tiers; what they say is checked by the engine's own config,
    built here once so that a bad value fails before any work, named by its flag."""
    if args.offload_tiers is None:
        given = [f"--offload-{name}-path" for name in args.offload_paths]
        given += [flag for flag, value in ((HOST_CACHE_FLAG, args.offload_host_cache_gb),
                                           (GPU_CACHE_FLAG, args.offload_gpu_cache_gb),
                                           ("--offload-update", args.offload_update),
                                           ("--offload-bandwidths", args.offload_bandwidths),
                                           ("--offload-token-scope", args.offload_token_scope or None))
                  if value is not None]
        if given:
            parser.error(f"argument {given[0]}: requires --offload-tiers")
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
    from megatron.training.errors import in_flags

    try:
        config_from_args(args, rank=0)
    except OffloadConfigError as err:
        parser.error(in_flags(str(err)))


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
