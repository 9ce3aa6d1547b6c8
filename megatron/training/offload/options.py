"""The engine's options, each declared once in ``OPTIONS`` (flag, type, default, help, the ``OffloadConfig``
field it fills); the parser (``add_flags``), the config's fields (``config_fields``) and engine messages in
flag names (``in_flags``) are made from it. It lives in the adapter, keyed by field, not in mlp_offload:
data flows plan -> tiers -> engine -> adapter, and the engine knows fields, never flags. A flag's default
is its field's own, read from OffloadConfig in the flag's unit, where the two mean the same."""

from __future__ import annotations

import argparse
import dataclasses
import re
from dataclasses import dataclass
from itertools import groupby
from typing import Any, Callable, Dict, List, Optional, Tuple

from megatron.training.errors import translate_messages_with
from megatron.training.flag_types import non_negative_float, non_negative_int, positive_int
from mlp_offload import GPU_TIER, GiB, MiB, OffloadConfig, parse_bandwidths

_FROM_FIELD = object()  # Option.default: the field's default, in the flag's unit

# Flags of other groups that fill engine fields (the precision-aware optimizer's, model.precision_aware):
# the names an engine message about those fields reads in.
REMAINDERS_FLAG = "--no-store-param-remainders"
STATE_DTYPE_FLAGS = ("--main-params-dtype", "--exp-avg-dtype", "--exp-avg-sq-dtype")
PATH_FLAG_FORM = "--offload-NAME-path"
GPU_START_FLAG = "--offload-gpu-start-gb"  # the adapter's own: where an auto gpu tier starts (gpu_tier_start)


@dataclass(frozen=True)
class Option:
    """One ``--offload-*`` flag. ``help``: at most two lines; ``{default}`` in it is the default."""

    flag: str
    help: str
    field: Optional[str] = None  # the OffloadConfig field it fills; None: the adapter's own option
    type: Optional[Callable[[str], Any]] = None
    default: Any = _FROM_FIELD
    choices: Optional[Tuple[str, ...]] = None
    metavar: Optional[str] = None
    unit: int = 1  # bytes per unit of the flag: the field holds int(value * unit)
    switch: bool = False  # a store_true flag
    clears: bool = False  # a switch that turns its field (True by default) off
    to_field: Optional[Callable[[Any], Dict[str, Any]]] = None  # value -> fields, where not the rules above
    error_names: Tuple[Tuple[str, Any], ...] = ()  # more (field, name) an engine message may use
    needs_tiers: bool = False  # refused without --offload-tiers

    @property
    def dest(self) -> str:
        return "offload_paths" if self.flag == PATH_FLAG_FORM else self.flag[2:].replace("-", "_")

    def parser_default(self):
        if self.switch:
            return False
        if self.default is not _FROM_FIELD:
            return self.default
        value = field_default(self.field)
        if self.unit == 1:
            return value
        whole, rest = divmod(value, self.unit)
        return whole if rest == 0 and self.type in (positive_int, non_negative_int) else value / self.unit

    def fields(self, value) -> Dict[str, Any]:
        """The config fields this flag's parsed ``value`` fills (none where it was not given and
        has no default of its own: the field's default stands)."""
        if self.field is None:
            return {}
        if self.to_field is not None:
            return self.to_field(value)
        if self.switch:
            return {self.field: not value if self.clears else bool(value)}
        if value is None:
            return {}
        return {self.field: value if self.unit == 1 else int(value * self.unit)}


def field_default(name: str):
    spec = OffloadConfig.__dataclass_fields__[name]
    return spec.default_factory() if spec.default is dataclasses.MISSING else spec.default


# value types of the flags below
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
    """TIER=SCOPE pairs; which scopes there are is the engine's config's to check."""
    scopes = {}
    for item in text.split(","):
        match = re.fullmatch(r"\s*([A-Za-z0-9_]+)\s*=\s*([A-Za-z]+)\s*", item)
        if not match:
            raise argparse.ArgumentTypeError(f"{item!r}: expected TIER=node or TIER=job, e.g. pfs=job")
        scopes[match.group(1)] = match.group(2)
    return scopes


def _gpu_cache(text: str):
    """``auto`` or GiB (a non-negative number)."""
    if text.strip().lower() == "auto":
        return "auto"
    try:
        return non_negative_float(text)
    except argparse.ArgumentTypeError:
        raise argparse.ArgumentTypeError(f"expected GiB (a number >= 0) or 'auto', got {text!r}") from None


def cpu_share(text: str):
    """--offload-cpu-share: a whole number of subgroups >= 0, or auto (the time model's choice)."""
    return "auto" if text == "auto" else non_negative_int(text)


def _gpu_budget(value) -> Dict[str, Any]:
    return {"gpu_budget_bytes": None if value in (None, "auto") else int(value * GiB),
            "gpu_budget_auto": value == "auto"}


# --offload-update's values, and the engine's update_on each gives
UPDATE_ON_OF_FLAG = {"auto": "auto", "cpu": "cpu", "gpu": "device"}

OPTIONS: Tuple[Option, ...] = (
    Option("--offload-tiers", "tiers for the optimizer state, fastest first: gpu, host and file tiers (each "
           f"with {PATH_FLAG_FORM}), e.g. host,nvme. Default: none, no offload", field="tiers", type=_tier_list,
           default=None, metavar="TIER,...", to_field=lambda v: {} if v is None else {"tiers": list(v)}),
    Option(PATH_FLAG_FORM, "directory of the file tier NAME of --offload-tiers, one flag per file tier (a tier ssd: "
           "--offload-ssd-path DIR). Default: none; each file tier needs one", field="paths",
           default=None, metavar="DIR", to_field=lambda v: {"paths": dict(v or {})}, needs_tiers=True,
           error_names=(("paths", lambda key: f"--offload-{key}-path"),)),
    Option("--offload-host-cache-gb", "pinned host memory per rank for optimizer state and I/O buffers; needed "
           "when host is mixed with file tiers. Default: none (host alone: all the state)",
           field="host_budget_bytes", type=non_negative_float, default=None, metavar="GB", unit=GiB,
           needs_tiers=True),
    Option("--offload-gpu-cache-gb", f"with {GPU_TIER} in --offload-tiers: device memory per rank for state updated "
           "in place; auto: learnt from each iteration's peak. Default: none", field="gpu_budget_bytes",
           type=_gpu_cache, default=None, metavar="GB|auto", unit=GiB, to_field=_gpu_budget, needs_tiers=True,
           error_names=(("gpu_budget_auto", "--offload-gpu-cache-gb auto"),)),
    Option(GPU_START_FLAG, "with --offload-gpu-cache-gb auto: the gpu tier's size until iteration 1's "
           "peak is measured (0: empty). Default: half of what the activation estimate leaves",
           type=non_negative_float, default=None, metavar="GB", unit=GiB),
    Option("--offload-gpu-margin-gb", "with --offload-gpu-cache-gb auto: device memory left free beside the "
           "training's peak. Default: {default}", field="gpu_margin_bytes", type=non_negative_float,
           metavar="GB", unit=GiB),
    Option("--offload-update", "where subgroups held in host memory are updated: CPU Adam, the GPU (streamed) or "
           "auto (per subgroup, from measured rates). Default: auto on a GPU, cpu on a CPU",
           field="update_on", choices=tuple(UPDATE_ON_OF_FLAG), default=None, needs_tiers=True,
           to_field=lambda v: {} if v is None else {"update_on": UPDATE_ON_OF_FLAG[v]}),
    Option("--offload-subgroup-size", "optimizer-state elements per subgroup, the unit of placement, I/O and "
           "update. Default: {default}", field="subgroup_size", type=positive_int, metavar="N"),
    Option("--offload-prefetch-depth", "subgroup reads kept in flight ahead of the update, per file tier. "
           "Default: {default}", field="prefetch_depth", type=positive_int, metavar="N"),
    Option("--offload-tokens-per-tier", "ranks of a node doing I/O on one tier path at once. Default: 1 where the "
           "start-up probe sees all ranks at once lose bandwidth, else all", field="tokens_per_tier",
           type=positive_int, metavar="N"),
    Option("--offload-token-scope", "who takes turns on a tier path: the ranks of each node (node) or of the "
           "whole job (job: a shared file system). Default: node", field="token_scope", type=_token_scopes,
           metavar="TIER=node|job,...", to_field=lambda v: {"token_scope": dict(v or {})}, needs_tiers=True,
           error_names=(("token_scope", lambda key: f"--offload-token-scope {key}"),)),
    Option("--offload-io-block-mb", "size of one read or write on a file tier. Default: {default}",
           field="io_block_bytes", type=positive_int, metavar="MB", unit=MiB),
    Option("--offload-io-threads", "I/O worker threads per file tier. Default: {default}", field="io_threads",
           type=positive_int, metavar="N"),
    Option("--offload-bandwidths", "file tiers' GB/s, used instead of probing them, e.g. nvme=3.0:2.8. Default: "
           "probed at start-up (cached per path)", field="bandwidths", default=None,
           metavar="TIER=READ:WRITE[:MIXED],...", to_field=lambda v: {"bandwidths": parse_bandwidths(v or "")},
           needs_tiers=True),
    Option("--offload-adam-kernel", "the CPU Adam kernel. Default: single on a CPU device (megatron-core's own, "
           "bit-identical), fused on a GPU (the fastest)", field="adam_kernel",
           choices=("fused", "foreach", "single"), default=None),
    Option("--offload-no-cache", "keep no subgroups in spare host buffers from one step to the next (reversed) "
           "one. Default: kept", field="cache_alternating", switch=True, clears=True),
    Option("--offload-overlap-forward", "start the next iteration's forward while the GPU still updates; each "
           "layer waits for its own params. Default: off; see docs/benchmarks.md", field="defer_device_wait",
           switch=True),
    Option("--offload-cpu-share", "with --offload-overlap-forward and --offload-update auto: host-held subgroups "
           "the CPU updates meanwhile; auto: the time model's. Default: none", field="cpu_share_subgroups",
           type=cpu_share, metavar="SUBGROUPS|auto"),
    Option("--offload-read-ahead-gb", "device memory for host-held state the GPU updates, copied in under the "
           "forward and backward before its step. Default: {default} (none)", field="device_read_ahead_bytes",
           type=non_negative_float, metavar="GB", unit=GiB),
    Option("--offload-no-one-pass-update", "GPU updates widen, step and round back in separate passes. Default: "
           "one kernel pass where it is bit-identical", field="device_one_pass", switch=True, clears=True),
    Option("--offload-no-update-in-model-buffers", "the GPU's one-pass update reads grads and writes params "
           "through copies. Default: in the model's own buffers", field="device_model_buffers", switch=True,
           clears=True),
    Option("--offload-no-interleave", "the GPU updates its subgroups held in memory in the schedule's order. "
           "Default: spread between those streamed from host memory", field="interleave_device_updates",
           switch=True, clears=True),
    Option("--offload-no-cpu-one-pass", "CPU updates widen, step and round back in separate passes. Default: one "
           "pass of a run-time built C++ kernel where it is bit-identical", field="cpu_one_pass", switch=True,
           clears=True),
    Option("--offload-no-odirect", "file tiers go through the page cache. Default: O_DIRECT where the file "
           "system allows it", field="use_odirect", switch=True, clears=True),
    Option("--offload-no-checksums", "no CRC32 per I/O block. Default: computed on write, verified on read",
           field="verify_checksums", switch=True, clears=True),
    Option("--offload-cpu-threads", "torch's CPU threads per rank, for the CPU Adam. Default: on a GPU node its "
           "cores shared by its ranks; else torch's", type=positive_int, default=None, metavar="N"),
    Option("--offload-save-staging-gb", "with --async-save: host memory per rank for state copied before the next "
           "update. Default: 4; where the writer is paced (a file tier on its disk), the state held in memory, made "
           "at start-up",
           field="save_staging_bytes", type=non_negative_float, default=None, metavar="GB", unit=GiB),
    Option("--offload-probe-mb", "size of the start-up bandwidth probe per file tier (its result is cached per "
           "path). Default: {default}", field="probe_bytes", type=positive_int, metavar="MB", unit=MiB),
    Option("--offload-activations", "host: each step runs layer by layer over its micro-batches, each layer's "
           "inputs kept in host memory until its recompute. Default: {default}", choices=("none", "host"),
           default="none"),
    Option("--offload-microbatch-group", "with the layer-major step: the step in passes of N micro-batches, each "
           "layer run for N before the next (N's layer inputs kept at a time, the params brought in once a pass). "
           "Default: one pass", type=positive_int, default=None, metavar="N"),
    Option("--offload-params", "host: the model's 16-bit params live in pinned host memory and reach the GPU "
           "a layer at a time in each step (with the layer-major step). Default: none", choices=("none", "host"),
           default="none", needs_tiers=True),
    Option("--offload-grads", "host: with --offload-params host, the grads live in pinned host memory too, each "
           "layer's summed in a GPU slot during its backward. Default: none", choices=("none", "host"),
           default="none", needs_tiers=True),
    Option("--offload-telemetry-log", "per-step engine telemetry as JSON lines; {{rank}} in FILE gives one file "
           "per rank, else rank 0 writes. Default: none", default=None, metavar="FILE"),
    Option("--offload-trace", "Chrome trace of the engine's I/O, waits and Adam at the end ({{rank}} as for "
           "--offload-telemetry-log; tools/plot_timeline.py). Default: none", field="trace_path", default=None,
           metavar="FILE"),
)
OPTION_OF_FLAG = {o.flag: o for o in OPTIONS}
ACTIVATIONS_IN_HOST = "--offload-activations host"  # as messages about the layer-major step name it
PARAMS_IN_HOST = "--offload-params host"
GRADS_IN_HOST = "--offload-grads host"


def activations_in_host_memory(args) -> bool:
    """--offload-activations host: the layer-major step, each layer's inputs in host memory."""
    return args.offload_activations == "host"


def params_in_host_memory(args) -> bool:
    """--offload-params host: the model's params in host memory, brought in by the layer-major step."""
    return getattr(args, "offload_params", "none") == "host"


def grads_in_host_memory(args) -> bool:
    """--offload-grads host: the model's grads in host memory too, each layer's made in a device slot."""
    return getattr(args, "offload_grads", "none") == "host"


def layer_major_flags(args) -> dict:
    """What the layer-major step is asked for (``model.layer_major``'s step_schedule and check_step_schedule
    take these), and the flag that asked, for its refusals."""
    params, grads = params_in_host_memory(args), grads_in_host_memory(args)
    return {"inputs_in_host": activations_in_host_memory(args), "params_in_host": params, "grads_in_host": grads,
            "asked_by": GRADS_IN_HOST if grads else PARAMS_IN_HOST if params else ACTIVATIONS_IN_HOST,
            "group": getattr(args, "offload_microbatch_group", None)}


def _flag_of(field: str) -> str:
    return next(o.flag for o in OPTIONS if o.field == field)


# The flags other modules name in their own lines.
HOST_CACHE_FLAG = _flag_of("host_budget_bytes")
GPU_CACHE_FLAG = _flag_of("gpu_budget_bytes")
GPU_MARGIN_FLAG = _flag_of("gpu_margin_bytes")


class _PathForm(argparse.Action):
    """``--offload-NAME-path`` as help lists it; the real flags (``--offload-nvme-path``) are taken
    from the unknown arguments (``args.offload.parse_offload_paths``): NAME typed as is is a mistake."""

    def __call__(self, parser, namespace, values, option_string=None):
        parser.error(f"argument {PATH_FLAG_FORM}: NAME stands for a file tier of --offload-tiers, "
                     f"e.g. --offload-ssd-path {values} for a tier ssd")


def add_flags(group) -> None:
    """The ``--offload-*`` flags, in the table's order, into an argparse group."""
    for option in OPTIONS:
        default = option.parser_default()
        shown = f"{default:g}" if isinstance(default, float) else default
        kwargs = {"help": option.help.format(default=shown), "default": default}
        if option.switch:
            kwargs["action"] = "store_true"
        elif option.flag == PATH_FLAG_FORM:
            kwargs.update(action=_PathForm, metavar=option.metavar)
        else:
            kwargs.update(type=option.type, choices=option.choices, metavar=option.metavar)
        group.add_argument(option.flag, **kwargs)


def config_fields(args) -> Dict[str, Any]:
    """OffloadConfig's fields from the ``--offload-*`` flags alone (that each field is OffloadConfig's
    and filled by one flag is tests/unit/test_offload_options.py's to check)."""
    fields = {}
    for option in OPTIONS:
        fields.update(option.fields(getattr(args, option.dest, option.parser_default())))
    return fields


def given_without_tiers(args) -> Optional[str]:
    """The first flag, as typed, that needs --offload-tiers and is given (tiers are not); None if none."""
    for option in OPTIONS:
        value = getattr(args, option.dest, None)
        if option.needs_tiers and value not in (None, {}, [], "none"):
            return f"--offload-{next(iter(value))}-path" if option.flag == PATH_FLAG_FORM else option.flag
    return None


@dataclass(frozen=True)
class _Name:
    """How an engine message's field reads as a flag: ``say(key)`` for a keyed field (``paths['nvme']``)."""

    flag: str = ""
    unit: int = 1
    say: Optional[Callable[[str], str]] = None


def _error_names() -> Dict[str, _Name]:
    names = {}
    for option in OPTIONS:
        if option.field is None or option.field == "tiers":  # "offload tiers" is prose in the engine's lines
            continue
        names[option.field] = _Name(option.flag, option.unit)
        for field, name in option.error_names:
            names[field] = _Name(say=name) if callable(name) else _Name(name)
    names["param_remainders"] = _Name(REMAINDERS_FLAG)
    names["state_dtypes"] = _Name(say=lambda index: STATE_DTYPE_FLAGS[int(index)])
    return names


ERROR_NAMES = _error_names()


def in_flags(message: str) -> str:
    """An engine message with its config field names (``host_budget_bytes=4194304``, ``paths['nvme']``,
    ``state_dtypes[1]``) replaced by the flags that set them, values in the flags' units."""
    runs = ["".join(chars) for _, chars in groupby(message, key=lambda c: c.isalnum() or c == "_")]
    said, at = [], 0
    while at < len(runs):
        text, used = _as_flag(runs, at)
        said.append(text)
        at += used
    return "".join(said)


def _as_flag(runs: List[str], at: int) -> Tuple[str, int]:
    """The flag for a field named at ``runs[at]`` and how many runs it took; else the run itself."""
    word, name = runs[at], ERROR_NAMES.get(runs[at])
    after = runs[at + 1] if at + 1 < len(runs) else ""
    if name is None:
        return word, 1
    if name.say is not None:  # keyed: field[key] or field['key']
        opened = after in ("[", "['", '["')
        if opened and at + 3 < len(runs) and runs[at + 3].startswith(after[1:] + "]"):
            close = runs[at + 3]
            return name.say(runs[at + 2]) + close[len(after):], 4
        return word, 1
    if "_" not in word and not after.startswith((":", " '")):
        return word, 1  # a word of prose (bandwidths), the field only where a value follows
    if after in ("=", "=-") and at + 2 < len(runs) and runs[at + 2].isdigit():
        value = float(runs[at + 2]) * (-1 if after == "=-" else 1)
        return f"{name.flag} {flag_figure(value, name.unit)}", 3
    return name.flag, 1


def flag_figure(value: float, scale: int) -> str:
    """``value`` in a flag's unit of ``scale`` bytes, as the user typed it: the shortest figure of up to
    6 significant digits that the flag reads back as ``value`` (it keeps ``int(figure * scale)``:
    --offload-host-cache-gb 0.001 is 1073741 bytes, which ``:g`` shows as 0.000999999); else ``:g``."""
    if scale != 1 and value == int(value):
        for digits in range(1, 7):
            figure = f"{value / scale:.{digits}g}"
            if int(float(figure) * scale) == value:
                return figure
    return f"{value / scale:g}"


translate_messages_with(in_flags)  # a user error from the engine, reported in the flags typed
