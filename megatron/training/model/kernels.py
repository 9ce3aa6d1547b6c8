"""What transformer-engine, apex and CUDA make possible, and Megatron-LM's defaults within that.

Megatron-LM turns its kernel fusions on by default and lets ``--no-*-fusion`` turn them off; here
each is on by default only where its kernel exists (off on a CPU run or without the package), so a
default command line runs anywhere. A flag that asks for something absent (an attention backend,
FP8, context parallelism) is an error of one line naming the flag and what is missing.
"""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass
from typing import List, Optional


def installed(module: str) -> bool:
    """Whether ``module`` can be imported here (found, not imported)."""
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):
        return False


@dataclass(frozen=True)
class Kernels:
    """What this process can use: decided once from the device and the installed packages."""

    cuda: bool
    transformer_engine: bool
    apex: bool
    grad_accum_kernel: bool  # apex's fused_weight_gradient_mlp_cuda

    @classmethod
    def detect(cls, device: str) -> "Kernels":
        if device == "auto":
            import torch  # only now: parsing stays light when the device is given

            cuda = torch.cuda.is_available()
        else:
            cuda = device == "cuda"
        return cls(cuda=cuda, transformer_engine=installed("transformer_engine"),
                   apex=installed("apex"), grad_accum_kernel=installed("fused_weight_gradient_mlp_cuda"))

    @property
    def te_layers(self) -> bool:
        return self.cuda and self.transformer_engine

    def missing_te(self) -> str:
        """Why transformer-engine layers cannot be used here ('' when they can)."""
        if not self.transformer_engine:
            return "transformer-engine is not installed"
        if not self.cuda:
            return "this is a CPU run (--device cpu or no CUDA device)"
        return ""


def resolve(args, kernels: Kernels, error) -> None:
    """Set args.transformer_impl, args.attention_backend and the fusion flags for this process;
    ``error(message)`` ends parsing with one line."""
    _resolve_attention(args, kernels, error)
    _resolve_fp8(args, kernels, error)
    _resolve_fusions(args, kernels)
    if args.apply_layernorm_1p and args.transformer_impl == "local" and not (kernels.apex and kernels.cuda):
        error("argument --apply-layernorm-1p: needs transformer-engine or apex layer norms (torch's "
              f"LayerNorm has no zero-centered gamma); {kernels.missing_te()}")


def _resolve_attention(args, kernels: Kernels, error) -> None:
    """transformer-engine's attention where its layers run; with megatron-core's local layers,
    torch's SDPA for flash/auto and megatron-core's unfused DotProductAttention for local/unfused
    (``args.core_attention`` records which; ``attention_line`` says it at start-up)."""
    if args.use_flash_attn:
        if args.attention_backend not in ("auto", "flash"):
            error(f"argument --use-flash-attn: not allowed with --attention-backend {args.attention_backend}")
        args.attention_backend = "flash"
    backend = args.attention_backend
    if args.transformer_impl is None:  # Megatron-LM's default is TE; where TE is absent, megatron-core's own
        args.transformer_impl = "transformer_engine" if kernels.te_layers and backend != "local" else "local"
    if args.transformer_impl == "transformer_engine":
        if not kernels.te_layers:
            error("argument --transformer-impl transformer_engine: needs transformer-engine on a CUDA device; "
                  f"{kernels.missing_te()}")
        if backend == "local":
            error("argument --attention-backend local: needs --transformer-impl local (Megatron-LM's --spec local)")
        args.core_attention = "transformer_engine"
        return
    if backend == "fused":  # cuDNN's fused attention comes only with transformer-engine
        flag = "--attention-backend fused"
        why = kernels.missing_te() or "--transformer-impl local runs megatron-core's own layers"
        error(f"argument {flag}: needs transformer-engine layers on a CUDA device; {why} "
              "(--attention-backend flash or auto runs torch's scaled_dot_product_attention)")
    args.core_attention = "sdpa" if backend in ("flash", "auto") else "unfused"
    if getattr(args, "multi_latent_attention", False):  # its key and value widths differ: model/mla_attention
        if backend == "flash":
            error("argument --attention-backend flash: multi-latent attention runs megatron-core's unfused "
                  "attention without transformer-engine (torch's SDPA is not wired for its widths)")
        args.core_attention = "unfused"
    args.attention_backend = "local"  # megatron-core's own layers run (no transformer-engine backend)


def attention_line(args, cuda_kernels: Optional[List[str]] = None) -> str:
    """The start-up line naming the attention kernel that runs; ``cuda_kernels``: on a GPU, the fused
    SDPA kernels torch admits for the model's attention (sdpa_attention.admitted_cuda_kernels)."""
    kind = getattr(args, "core_attention", "unfused")
    if kind == "transformer_engine":
        return f"> attention: transformer-engine's (--attention-backend {args.attention_backend})"
    if kind == "sdpa":
        line = "> attention: torch scaled_dot_product_attention in megatron-core's local layers"
        if cuda_kernels is None:
            return line + " (on CPU its flash kernel, or its math kernel with attention dropout; exact up to rounding)"
        if not cuda_kernels:
            return (line + ": no fused kernel of torch admits this model's attention on this GPU, so its math "
                    "kernel runs, which materialises the score matrix as the unfused attention does")
        return line + f": torch picks among its {', '.join(cuda_kernels)} kernel(s) here (exact up to rounding)"
    return ("> attention: megatron-core's unfused DotProductAttention (the full score matrix; "
            "--attention-backend auto or flash runs torch's scaled_dot_product_attention)")


def _resolve_fp8(args, kernels: Kernels, error) -> None:
    if args.fp8_format is None:
        for flag, given in (("--fp8-param-gather", args.fp8_param_gather),
                            ("--fp8-recipe", args.fp8_recipe is not None)):
            if given:
                error(f"argument {flag}: requires --fp8-format")
        return
    if not kernels.te_layers:
        error(f"argument --fp8-format {args.fp8_format}: FP8 needs transformer-engine on a CUDA device; "
              f"{kernels.missing_te()}")
    if args.transformer_impl != "transformer_engine":
        error(f"argument --fp8-format {args.fp8_format}: needs --transformer-impl transformer_engine")


def _resolve_fusions(args, kernels: Kernels) -> None:
    """Megatron-LM's defaults (all on) where the kernel exists; off otherwise."""
    te, cuda = args.transformer_impl == "transformer_engine", kernels.cuda
    bias_act = args.bias_swiglu_fusion if args.swiglu else args.bias_gelu_fusion
    # megatron-core builds its fused bias and cross-entropy kernels with torch.compile (megatron.core.jit):
    # meant for CUDA; on a CPU run inductor spends long on them (docs/design.md, "CPU as a device").
    # Without a bias nothing is fused.
    args.bias_activation_fusion = bool(bias_act and cuda and not args.disable_bias_linear)
    args.bias_dropout_fusion = bool(args.bias_dropout_fusion and cuda)
    args.cross_entropy_loss_fusion = bool(args.cross_entropy_loss_fusion and cuda)
    # the scaled-masked-softmax kernels ship with transformer-engine or apex
    args.masked_softmax_fusion = bool(args.masked_softmax_fusion and cuda
                                      and (kernels.transformer_engine or kernels.apex))
    args.apply_rope_fusion = bool(args.apply_rope_fusion and te and args.position_embedding_type == "rope")
    args.gradient_accumulation_fusion = bool(args.gradient_accumulation_fusion and cuda and kernels.grad_accum_kernel)
    # apex's and TE's layer norms have it; torch's LayerNorm (the local spec without apex) has none
    args.persist_layer_norm = bool(not args.no_persist_layer_norm and cuda and (te or kernels.apex))
