"""Megatron-LM's precision-aware optimizer flags: the stored dtype of the master params and of
Adam's two moments, for megatron-core's optimizer (transformer-engine's FusedAdam does the work) or
for the offload engine (``OffloadConfig.state_dtypes``, every tier).

fp8 moments differ between the two: transformer-engine's FusedAdam keeps one scale per tensor; the
offload engine keeps one fp32 scale per block of 128 elements of each param, the first moment as
e4m3 codes and the second as e4m3 codes of its square root (``mlp_offload.state_formats.FP8_MOMENTS``).
"""

from __future__ import annotations

from megatron.training.model.kernels import Kernels
from mlp_offload import codec_named

DTYPE_FLAGS = ("--main-params-dtype", "--exp-avg-dtype", "--exp-avg-sq-dtype")


def add_flags(g) -> None:
    g.add_argument("--use-precision-aware-optimizer", action="store_true",
                   help="store master params and Adam moments in the dtypes below (fp32 math, rounded on store); "
                        "the offload engine honours it in every tier, megatron-core needs transformer-engine")
    g.add_argument("--main-params-dtype", choices=["fp32", "fp16"], default="fp32",
                   help="with --use-precision-aware-optimizer: the stored dtype of the master params. "
                        "Default: %(default)s")
    g.add_argument("--exp-avg-dtype", choices=["fp32", "fp16", "bf16", "fp8"], default="fp32",
                   help="with --use-precision-aware-optimizer: the stored dtype of Adam's first moment. "
                        "Default: %(default)s")
    g.add_argument("--exp-avg-sq-dtype", choices=["fp32", "fp16", "bf16", "fp8"], default="fp32",
                   help="with --use-precision-aware-optimizer: the stored dtype of Adam's second moment. "
                        "Default: %(default)s")
    g.add_argument("--no-store-param-remainders", action="store_false", dest="store_param_remainders",
                   help="keep the whole fp32 master: by default, with --bf16 and an fp32 master, only its low 16 bits "
                        "are stored beside the bf16 param (lossless; offload: 10 instead of 12 B/param, 6 with "
                        "bf16 moments; megatron-core: with the precision-aware optimizer's FusedAdam)")


def validate(parser, args) -> None:
    """One line naming the flag where the dtypes cannot be honoured here."""
    given = [(flag, _value(args, flag)) for flag in DTYPE_FLAGS if _value(args, flag) != "fp32"]
    if not args.use_precision_aware_optimizer:
        if given:
            parser.error(f"argument {given[0][0]}: requires --use-precision-aware-optimizer")
        return
    if args.offload_tiers:  # the engine's config checks the dtypes (args.offload builds it)
        return
    if not args.use_distributed_optimizer:
        parser.error("argument --use-precision-aware-optimizer: requires the distributed optimizer "
                     "(--use-distributed-optimizer)")
    if not args.optimizer_cpu_offload and not Kernels.detect(args.device).transformer_engine:
        parser.error("argument --use-precision-aware-optimizer: megatron-core's optimizer needs transformer-engine's "
                     "FusedAdam, and transformer-engine is not installed (or use --offload-tiers)")


def state_dtypes(args):
    """The offload engine's stored (param, exp_avg, exp_avg_sq) dtypes."""
    if not getattr(args, "use_precision_aware_optimizer", False):
        return ("fp32", "fp32", "fp32")
    return tuple(_value(args, flag) for flag in DTYPE_FLAGS)


def param_remainders(args) -> bool:
    """The offload engine stores the master as remainders: on by default where the model is bf16 and
    the master fp32 (each shard turns it off where a param buffer is not bf16)."""
    return (getattr(args, "store_param_remainders", True) and bool(getattr(args, "bf16", False))
            and state_dtypes(args)[0] == "fp32")


def optimizer_config_fields(args) -> dict:
    """megatron-core's OptimizerConfig fields; none for the offload engine, which takes the dtypes
    itself (megatron-core would otherwise demand transformer-engine for it). megatron-core stores
    remainders only in transformer-engine's FusedAdam of the precision-aware optimizer: the flag
    goes there, and elsewhere its default (on, unused) stays."""
    if not getattr(args, "use_precision_aware_optimizer", False) or args.offload_tiers:
        return {}
    import torch

    fields = {"use_precision_aware_optimizer": True,
              "store_param_remainders": getattr(args, "store_param_remainders", True)}
    for flag in DTYPE_FLAGS:
        value = _value(args, flag)
        fields[flag[2:].replace("-", "_")] = torch.uint8 if value == "fp8" else codec_named(value).storage_dtype
    return fields


def _value(args, flag: str) -> str:
    return getattr(args, flag[2:].replace("-", "_"))
