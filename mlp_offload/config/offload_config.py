"""OffloadConfig: every knob of the offload engine in one typed, validated place.

Follows megatron-core's config-dataclass style: plain fields with defaults, checked in
``__post_init__`` so that a bad value fails when the config is built, not deep inside a step.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Dict, List, Optional, Sequence, Tuple, Union

from ..state_formats import (FP32_STATE, REMAINDERS16, STATE_TENSORS, StateCodec, UnsupportedStateDtype, codec_named,
                             dtype_name)
from ..tiers.kinds import DEVICE_MEMORY, HOST_MEMORY, MEMORY_KINDS, kind_of, memory_kind_names
from .align import ALIGN
from .bandwidth import TierBandwidth, probe_piece_bytes
from .checks import OffloadConfigError, is_int, positive, positive_finite
from .device_checks import check_device_fields
from .tier_checks import TOKEN_SCOPES, check_tier_fields
from .units import GiB, MiB

HOST_TIER = HOST_MEMORY.name
GPU_TIER = DEVICE_MEMORY.name  # the model's device memory (HBM; on a CPU run, the CPU's memory: the CPU twin)
# Tier names that are memory (tiers.base.ResidentTier kinds), fastest first; every other name is a
# file path. Placement fills them in this order.
RESIDENT_TIERS = memory_kind_names()
DEFAULT_SAVE_STAGING = 4 * GiB  # save_staging_bytes where none is given and the writer is not paced


@dataclass
class OffloadConfig:
    """Where one rank's optimizer state lives and how it moves.

    ``tiers`` is an ordered list: ``"host"`` (pinned host memory, a capacity-bounded cache) and
    any number of named file tiers, each with a directory in ``paths``. Order breaks ties in
    placement (earlier tiers are preferred when the model predicts equal times).
    """

    tiers: List[str] = field(default_factory=lambda: [HOST_TIER])
    """Tier names in preference order, e.g. ``["host", "nvme", "pfs"]``."""

    paths: Dict[str, str] = field(default_factory=dict)
    """Directory for each file tier, e.g. ``{"nvme": "/local/ssd", "pfs": "/lustre/me"}``."""

    host_budget_bytes: Optional[int] = None
    """Host memory for optimizer state: host-resident subgroups plus pipeline/cache buffers.
    ``None`` means: everything in host memory when ``tiers == ["host"]``; just the minimum
    pipeline buffers when ``"host"`` is not listed. Required when host and file tiers are mixed."""

    gpu_budget_bytes: Optional[int] = None
    """Device memory (the ``"gpu"`` tier) for resident subgroups, updated where they live. Required
    with ``"gpu"`` unless ``gpu_budget_auto``; then it is where the auto mode starts (None: 0)."""

    gpu_budget_auto: bool = False
    """Learn the ``"gpu"`` tier's size from the device's real peak after steps (``observe_device_memory``):
    promote subgroups into spare memory beyond ``gpu_margin_bytes``, hand them back when it shrinks."""

    gpu_margin_bytes: int = 4 * GiB
    """Device memory the auto mode leaves free beside the training's own peak."""

    device: str = "cpu"
    """The model's device (``"cuda:0"``, ``"cpu"``): home of the ``"gpu"`` tier and of device updates.
    On ``"cpu"`` both run the same code on the CPU (the CPU twin the tests exercise)."""

    update_on: str = "cpu"
    """Where subgroups held in host memory are updated: ``"cpu"`` (CPU Adam), ``"device"`` (state
    streamed to the device and back, overlapped) or ``"auto"`` (per subgroup, from the measured
    rates, so CPU and device update different subgroups at once). Device-resident ones always
    update on the device."""

    device_adam_kernel: Optional[str] = None
    """Adam kernel of device updates; None: ``"foreach"`` on CUDA (torch.optim.AdamW's default
    there, megatron-core's kernel without apex/TE), ``adam_kernel`` on the CPU twin."""

    defer_device_wait: bool = False
    """``step()`` returns with the device's work still queued: its subgroups in descending index
    order (the Megatron adapter's flat space runs from the last layer to the first, so this is the
    next forward's order), each one's ``params_ready(i)`` event for the caller to wait on before it
    uses those params, and nothing of the state touched on the host before ``settle()`` (which every
    state access and the next step call first). The caller must also not change the gradients the
    update reads before it has read them (the Megatron adapter zeroes them as they are read)."""

    cpu_share_subgroups: Union[int, str, None] = None
    """With ``defer_device_wait`` and ``update_on`` "auto": how many of the subgroups resident in host
    memory the CPU updates (spread over the order; at most all of them), whatever the time model
    predicts; None or 0: none, all streamed through the device (the default: the CPU's work can slow
    the device's streaming more than the model counts, docs/benchmarks.md); "auto": the model's choice
    (``plan.overlap_split``: a share only where the update the iteration sees is predicted shorter)."""

    hold_update_split: bool = False
    """With ``update_on`` "auto": the CPU/device split stays as start-up chose it, whatever the steps'
    timings show (a deterministic run repeats its work, not only its results)."""

    device_one_pass: bool = True
    """On CUDA, update with one kernel pass per element (``fused_update``) where it is bit-identical
    to the multi-pass path on a start-up sample; False: always the multi-pass path."""

    device_model_buffers: bool = True
    """With the one-pass kernel, read the model's grads and write its params where the model keeps
    them (the grad and param sources' ``views``), instead of through an fp32 grad copy and a bf16
    param copy each way (about 36 bytes an element moved become 20); False: through the copies."""

    interleave_device_updates: bool = True
    """On a GPU, the device's subgroups held in memory are queued with the in-HBM ones spread between
    the streamed ones (``step.loop.interleaved``): the compute stream works while the host link copies,
    and the update takes the longer of the two instead of their sum; False: the schedule's order (a
    run of in-HBM updates holds the link's copies back). With ``defer_device_wait`` only in the steps
    the caller waits for (``step(in_series=True)``); the others run in the next forward's order."""

    cpu_one_pass: bool = True
    """Update on the CPU with one pass per element (``cpu_one_pass``, a C++ kernel built at run time)
    where it is bit-identical to the multi-pass path on a start-up sample; False: always the
    multi-pass path (widen, torch's AdamW, round back)."""

    device_chunk_elems: int = 100_000_000
    """Elements per chunk of a streamed device update (copy-in, Adam, copy-out overlap per chunk)."""

    device_read_ahead_bytes: int = 0
    """Device memory for reading host-held subgroups the device updates into it before their step
    (``read_ahead``): their copies in run under the forward and backward before it, while the host
    link idles, and the update waits only for their Adam and copies out. 0: none. At least one
    subgroup's stored state where not 0."""

    device_adam_elems_per_s: Optional[float] = None
    """Device Adam rate on resident state (elements/s) to use instead of measuring it."""

    device_streamed_elems_per_s: Optional[float] = None
    """Elements/s of the streamed device update (copies and Adam overlapped) instead of measuring it."""

    subgroup_size: int = 100_000_000
    """Elements per subgroup (the last one is shorter)."""

    prefetch_depth: int = 2
    """Subgroup reads kept in flight ahead of the update, per file tier."""

    tokens_per_tier: Optional[int] = None
    """Node-wide I/O tokens per tier path: how many processes of a node may do I/O on it at once.
    None: decided per tier from the probe (see ``placement.tokens_for``)."""

    token_scope: Dict[str, str] = field(default_factory=dict)
    """Per file tier, who takes turns on its path: ``"node"`` (the default: the node's ranks, each
    node on its own, through node-local locks) or ``"job"`` (the job's ranks on every node, through
    the job's key-value store, which the engine then needs as ``token_store``). Job scope is for a
    path all nodes share whose total bandwidth does not grow with the nodes using it."""

    io_block_bytes: int = 8 * MiB
    """Size of one read/write syscall; a multiple of the O_DIRECT alignment."""

    io_threads: int = 4
    """Worker threads per file tier (their syscalls run without the GIL)."""

    use_odirect: bool = True
    """Bypass the page cache where the file system allows it; logged where it does not."""

    verify_checksums: bool = True
    """CRC32 per I/O block, computed on write and verified on read."""

    cache_alternating: bool = True
    """Alternate the update order each step and keep the tail of one step in spare host
    buffers, so the next (reversed) step skips their write and read. Off: nothing is reused
    across steps; every streamed subgroup is written and read back from its tier each step."""

    bandwidths: Dict[str, TierBandwidth] = field(default_factory=dict)
    """Per file tier: measured bandwidths to use instead of probing."""

    adam_elems_per_s: Optional[float] = None
    """CPU Adam rate to use instead of measuring it."""

    probe_bytes: int = 1024 * MiB
    """Size of the bandwidth probe file; results are cached per path."""

    pin_memory: Optional[bool] = None
    """Pin host buffers (for async copies to/from the GPU). ``None``: pin when CUDA is available."""

    adam_kernel: str = "fused"
    """``"fused"`` (torch's fused CPU AdamW, fastest) or ``"foreach"``/``"single"`` to match an
    unfused ``torch.optim.AdamW`` bit for bit."""

    run_id: Optional[str] = None
    """Namespace of this run's files (the Megatron adapter gives the job's: MLP_OFFLOAD_RUN_ID, else
    SLURM's job and step, else torchrun's run id); None: one per process."""

    rank: int = 0
    """Rank whose shard this engine holds; files are namespaced by it."""

    ranks_sharing_node: Optional[int] = None
    """Processes of this node that place state on the same paths (for the free-space check).
    ``None``: 1 (the Megatron adapter gives ``LOCAL_WORLD_SIZE``)."""

    host_bytes_beside: Dict[str, int] = field(default_factory=dict)
    """Host memory each rank of the node holds beside the engine's buffers, by name (the process
    itself, its data-loading workers): the start-up check counts it with them against the node's."""

    trace_path: Optional[str] = None
    """Write a Chrome-trace JSON of this engine's reads, writes, waits and Adam here when it closes
    (see ``trace``); None: nothing is timed or recorded beyond the per-step telemetry."""

    state_dtypes: Sequence[str] = FP32_STATE
    """Stored dtype of (master params, exp_avg, exp_avg_sq): ``"fp32"``, ``"fp16"`` or ``"bf16"``
    each (torch dtypes are accepted too). Narrower ones are widened to fp32 for the update and
    rounded back after it; every tier, placement and checkpoint then counts their smaller bytes."""

    param_remainders: bool = False
    """Store the fp32 master as its low 16 bits beside the bf16 param the model holds (its high
    half; see ``remainders``): 2 bytes per param instead of 4 in every tier and checkpoint, lossless.
    Needs an fp32 master (``state_dtypes[0]``) and bf16 model params, which the engine reads from its
    ``param_high`` source and writes back through ``on_params_updated`` (bf16, rounded half away)."""

    save_staging_bytes: Optional[int] = None
    """Background checkpoint saves: host memory (outside the budget, taken only when needed) for
    copies of subgroups held in memory that the next update reaches before the writer has them;
    beyond it the update waits for the writer (see ``snapshot``). ``None``: ``DEFAULT_SAVE_STAGING``,
    raised for a writer paced behind a file tier on the checkpoint's disk to the state held in memory,
    as host memory allows (``checkpoint.pacing``)."""

    lock_dir: Optional[str] = None
    """Node-local directory for the lock files of the I/O tokens and of the bandwidth probe (one
    sub-directory per user and tier path). ``None``: ``/dev/shm`` where writable, else the temporary
    directory (the Megatron adapter gives ``MLP_OFFLOAD_LOCK_DIR``)."""

    local_rank: int = 0
    """This rank's place among the node's ranks: only the node's first (0) lists the stale swap
    namespaces of dead runs it finds, so each is reported once per node (the Megatron adapter gives
    ``LOCAL_RANK``)."""

    def __post_init__(self):
        self.state_dtypes = _state_dtype_names(self.state_dtypes)
        if not isinstance(self.param_remainders, bool):
            raise OffloadConfigError(f"param remainders (param_remainders) must be True or False, "
                                     f"got {self.param_remainders!r}")
        if self.param_remainders and self.state_dtypes[0] != "fp32":
            raise OffloadConfigError(f"param remainders (param_remainders) complete an fp32 master; the master's "
                                     f"state dtype (state_dtypes[0]) is {self.state_dtypes[0]}")
        if isinstance(self.tiers, str):
            self.tiers = [t.strip() for t in self.tiers.split(",") if t.strip()]
        check_tier_fields(self)
        check_device_fields(self)
        positive("subgroup_size", self.subgroup_size)
        positive("prefetch_depth", self.prefetch_depth)
        if self.tokens_per_tier is not None:
            positive("tokens_per_tier", self.tokens_per_tier)
        positive("io_threads", self.io_threads)
        if self.ranks_sharing_node is not None:
            positive("ranks_sharing_node", self.ranks_sharing_node)
        if not is_int(self.probe_bytes) or self.probe_bytes < MiB:
            raise OffloadConfigError(
                f"the bandwidth probe (probe_bytes) needs a whole number of bytes, at least 1 MiB; got {self.probe_bytes!r}")
        if not is_int(self.io_block_bytes) or self.io_block_bytes <= 0 or self.io_block_bytes % ALIGN:
            raise OffloadConfigError(
                f"I/O block size (io_block_bytes) must be a positive multiple of {ALIGN} bytes, "
                f"got {self.io_block_bytes!r}"
            )
        if self.save_staging_bytes is not None and (not is_int(self.save_staging_bytes)
                                                     or self.save_staging_bytes < 0):
            raise OffloadConfigError(f"save staging (save_staging_bytes) must be a whole number of bytes >= 0, "
                                     f"got {self.save_staging_bytes!r}")
        if self.adam_kernel not in ("fused", "foreach", "single"):
            raise OffloadConfigError(
                f"adam kernel (adam_kernel) must be 'fused', 'foreach' or 'single', got {self.adam_kernel!r}"
            )
        if any(name not in self.bandwidths for name in self.file_tiers):
            probe_piece_bytes(self.probe_bytes, self.prefetch_depth)  # a tier will be probed
        rate = self.adam_elems_per_s
        if rate is not None and not positive_finite(rate):
            raise OffloadConfigError(f"Adam rate (adam_elems_per_s) must be a positive finite number, got {rate!r}")
        _check_node_fields(self.lock_dir, self.local_rank)

    @property
    def has_host(self) -> bool:
        return HOST_TIER in self.tiers

    @property
    def resident_tiers(self) -> List[str]:
        """The listed memory tiers, fastest first (the order placement fills them)."""
        return [k.name for k in MEMORY_KINDS if k.name in self.tiers]

    def budget_of(self, tier: str) -> Optional[int]:
        """A resident tier's byte budget (None: unbounded, or learnt for the auto gpu tier)."""
        kind = kind_of(tier)
        if not kind.resident:
            raise KeyError(tier)
        budget = getattr(self, kind.budget_field)
        if kind.in_device_memory and budget is None:  # 0 is a budget too (the tier listed, holding nothing)
            return 0 if self.gpu_budget_auto else None
        return budget

    @property
    def on_cuda(self) -> bool:
        return self.device.startswith("cuda")

    @property
    def resolved_device_adam_kernel(self) -> str:
        if self.device_adam_kernel is not None:
            return self.device_adam_kernel
        return "foreach" if self.on_cuda else self.adam_kernel

    @property
    def state_codecs(self) -> Tuple[StateCodec, StateCodec, StateCodec]:
        """How (param, exp_avg, exp_avg_sq) are stored (``state_formats``): ``state_dtypes``, the
        master as remainders where ``param_remainders``."""
        codecs = tuple(codec_named(name, tensor) for name, tensor in zip(self.state_dtypes, STATE_TENSORS))
        if self.param_remainders:
            return (REMAINDERS16, *codecs[1:])
        return codecs

    @property
    def stored_dtypes(self) -> Tuple[str, str, str]:
        """The tags of ``state_codecs``, as checkpoint footers and start-up lines give them."""
        return tuple(c.describe() for c in self.state_codecs)

    @property
    def file_tiers(self) -> List[str]:
        return [t for t in self.tiers if kind_of(t).needs_path]

    def resolved_run_id(self) -> str:
        if self.run_id:
            return self.run_id
        # Per-process fallback: unique, and files of a dead run are never mistaken for ours.
        self.run_id = f"pid{os.getpid()}"
        return self.run_id

    def resolved_ranks_sharing_node(self) -> int:
        if self.ranks_sharing_node is not None:
            return self.ranks_sharing_node
        return 1


def _state_dtype_names(values) -> Tuple[str, str, str]:
    values = tuple(values)
    if len(values) != len(STATE_TENSORS):
        raise OffloadConfigError(f"state dtypes (state_dtypes) needs one dtype for each of {STATE_TENSORS}, "
                                 f"got {values!r}")
    names = []
    for tensor, value in zip(STATE_TENSORS, values):
        try:
            names.append(dtype_name(value))
            codec_named(value, tensor)
        except UnsupportedStateDtype as err:
            raise OffloadConfigError(f"state dtype of {tensor} (state_dtypes): {err}") from None
    if (names[1] == "fp8") != (names[2] == "fp8"):
        raise OffloadConfigError(f"the moments' state dtypes (state_dtypes[1], state_dtypes[2]) are {names[1]}/"
                                 f"{names[2]}: fp8 moments are updated together in one kernel, so both are fp8 "
                                 f"or neither is")
    return tuple(names)


def _check_node_fields(lock_dir, local_rank) -> None:
    if lock_dir is not None and (not isinstance(lock_dir, str) or not lock_dir):
        raise OffloadConfigError(f"lock directory (lock_dir) must be a non-empty path or None, got {lock_dir!r}")
    if not is_int(local_rank) or local_rank < 0:
        raise OffloadConfigError(f"local rank (local_rank) must be a whole number >= 0, got {local_rank!r}")
