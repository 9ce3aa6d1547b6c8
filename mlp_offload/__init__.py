"""mlp_offload: multi-level, multi-path offload of optimizer state (usable without Megatron).

This module is the engine's face: code outside the engine (the Megatron adapter, tools, benchmarks)
imports from here, or from ``mlp_offload.checkpoint`` (the checkpoint file format); everything else
is the engine's inside and may change without notice (tests/unit/test_layout.py keeps it so).
"""

from .plan.capacity import EnginePlan, plan_engine
from .checkpoint import (BackgroundStateWrite, CheckpointDataError, CheckpointSaveError, save_engine_state,
                         start_background_save)
from .config import GPU_TIER, HOST_TIER, OffloadConfig, OffloadConfigError, TierBandwidth, parse_bandwidths
from .engine import PER_NODE, OffloadedAdamW, OffloadStateError
from .model_link import ModelLink
from .pipeline import ModelParamsAsMaster
from .faults import configure as configure_faults, fault_point
from .plan.placement import PlacementError, UpdateRates, min_host_budget_bytes
from .plan.node_share import streamed_elems_per_s
from .plan.prediction import MeasuredRates, device_seconds, first_forward_share, predict_iteration
from .step.path_rates import measure_update_paths
from .plan.rates import measure_adam_rate, measure_convert_rate
from .kernels.remainders import merge as merge_remainders, split as split_remainders
from .startup.measure import probe_file_tier as probe_tier  # the start-up's tier probe, for the planner tool
from .state_formats import StateCodec, bytes_per_param, codec_named, codecs_for
from .subgroups.partition import FP32_BYTES, STATE_TENSORS
from .telemetry.traffic import StepRecord, TierTraffic
from .tiers.files import FileIo, FileTier, TierDataError, TierIOError, TierOwner, TierPathError, fsync_path
from .tiers.host import HostMemory, HostMemoryError, check_host_memory, meminfo_bytes, own_pss_bytes
from .tiers.no_fork import unforked_zeros
from .tiers.housekeeping import NamespaceInUseError, scan as scan_namespaces
from .tiers.housekeeping import release_all as release_swap_namespaces
from .tiers.housekeeping import tree_bytes
from .tiers.kinds import DEVICE_MEMORY, HOST_MEMORY, MEMORY_KINDS, TierKind, kind_of
from .tiers.tokens import JobTokens, TierTokens
from .kernels.update import AdamKernel
from .kernels import blockwise8  # 8-bit block-scaled moments, not yet a stored format (benchmarks)
from .kernels.fused_update import AdamHyper
from .kernels.cpu_one_pass import build_in_background as build_cpu_kernel_in_background
from .config.units import GB, GiB, MiB

__all__ = [
    # configuration and its errors
    "OffloadConfig", "OffloadConfigError", "TierBandwidth", "parse_bandwidths", "GPU_TIER", "HOST_TIER",
    # tier kinds: what a tier is, asked instead of its name
    "TierKind", "kind_of", "MEMORY_KINDS", "DEVICE_MEMORY", "HOST_MEMORY",
    # the optimizer, its records and errors
    "OffloadedAdamW", "ModelParamsAsMaster", "OffloadStateError", "PlacementError", "StepRecord", "TierTraffic", "PER_NODE",
    "ModelLink",
    "TierDataError", "TierIOError", "TierPathError", "HostMemoryError", "NamespaceInUseError",
    "STATE_TENSORS", "FP32_BYTES",
    # stored state formats: one codec each (fp32, bf16, fp16, rem16), from a user's name or a saved tag
    "StateCodec", "codec_named", "codecs_for", "bytes_per_param",
    # 16-bit master remainders: fp32 master <-> (int16 remainders, bf16 params)
    "split_remainders", "merge_remainders",
    # checkpoints (the file format itself: mlp_offload.checkpoint)
    "CheckpointDataError", "CheckpointSaveError", "BackgroundStateWrite", "save_engine_state",
    "start_background_save", "fsync_path",
    # host memory children of the rank do not inherit, committed as it is written (pinned where the caller asks)
    "unforked_zeros",
    # planning and measuring without an engine (tools/plan_offload.py, benchmarks/)
    "EnginePlan", "plan_engine", "MeasuredRates", "min_host_budget_bytes", "probe_tier", "measure_adam_rate", "measure_convert_rate",
    "device_seconds", "measure_update_paths", "predict_iteration", "first_forward_share", "UpdateRates",
    "streamed_elems_per_s",
    "AdamKernel", "AdamHyper", "blockwise8", "build_cpu_kernel_in_background", "HostMemory", "check_host_memory", "own_pss_bytes", "FileTier", "JobTokens", "TierTokens", "meminfo_bytes",
    "FileIo", "TierOwner",
    # process housekeeping and crash-test fault points
    "scan_namespaces", "release_swap_namespaces", "tree_bytes", "fault_point", "configure_faults",
    # byte units (mlp_offload/config/units.py), for every package
    "MiB", "GiB", "GB",
]
