"""Megatron-LM's mixture-of-experts flags, with its defaults (those of megatron-core's
TransformerConfig, from which upstream generates them) and its checks.

The experts are megatron-core's own MoE layers (``megatron.core.transformer.moe``). Where a flag asks
for a kernel this process lacks, it says so in one line; ``--moe-grouped-gemm`` without its kernel
(the ``grouped_gemm`` package, or transformer-engine on CUDA) runs megatron-core's sequential experts,
the same arithmetic one expert at a time, and says so once.
"""

from __future__ import annotations

import argparse
import ast
from typing import List, Union

from megatron.training.errors import finite, non_negative_float, non_negative_int, positive_int
from megatron.training.model.moe import moe_layers

LOAD_BALANCING = ("aux_loss", "seq_aux_loss", "global_aux_loss", "sinkhorn", "none")


def layer_pattern(text: str) -> Union[int, List[int]]:
    """--moe-layer-freq: N (every N-th layer is MoE, from layer 0) or a list expression such as
    ``([1]*3+[0])*2`` of 0/1 per layer. Parsed, never evaluated: only lists of 0/1, + and * by ints."""
    text = text.strip()
    if "[" not in text:
        value = int(text)
        if value <= 0:
            raise argparse.ArgumentTypeError(f"must be a positive integer or a pattern like ([1]*3+[0])*2, got {text}")
        return value
    try:
        value = _pattern(ast.parse(text, mode="eval").body)
    except (SyntaxError, ValueError) as err:
        raise argparse.ArgumentTypeError(f"expected a pattern like ([1]*3+[0])*2 of 0s and 1s, got {text!r} ({err})")
    if not isinstance(value, list) or not value:
        raise argparse.ArgumentTypeError(f"expected a non-empty list pattern of 0s and 1s, got {text!r}")
    return value


def _pattern(node):
    if isinstance(node, ast.List):
        items = [_pattern(e) for e in node.elts]
        if any(i not in (0, 1) or isinstance(i, list) for i in items):
            raise ValueError("list entries must be 0 or 1")
        return items
    if isinstance(node, ast.Constant) and isinstance(node.value, int) and not isinstance(node.value, bool):
        return node.value
    if isinstance(node, ast.BinOp) and isinstance(node.op, (ast.Add, ast.Mult)):
        left, right = _pattern(node.left), _pattern(node.right)
        if isinstance(node.op, ast.Add) and isinstance(left, list) and isinstance(right, list):
            return left + right
        if isinstance(node.op, ast.Mult) and isinstance(left, list) != isinstance(right, list):
            lst, n = (left, right) if isinstance(left, list) else (right, left)
            if n < 0 or n > 100_000:
                raise ValueError(f"repeat count {n} out of range")
            return lst * n
    raise ValueError("only [0/1, ...], + of lists and * by an integer are allowed")


def add_flags(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("mixture of experts (Megatron-LM; megatron-core's MoE layers)")
    g.add_argument("--num-experts", type=non_negative_int, default=None, help="experts per MoE layer (0 or none: dense)")
    g.add_argument("--moe-ffn-hidden-size", type=positive_int, default=None,
                   help="each expert's FFN size (default --ffn-hidden-size)")
    g.add_argument("--moe-layer-freq", type=layer_pattern, default=1,
                   help="N: every N-th layer is MoE; or a 0/1 pattern per layer such as ([0]+[1]*23)")
    g.add_argument("--moe-shared-expert-intermediate-size", type=positive_int, default=None,
                   help="FFN size of the shared experts every token goes through (none by default)")
    g.add_argument("--moe-shared-expert-overlap", action="store_true",
                   help="run the shared experts during the token dispatch (alltoall dispatcher only)")
    g.add_argument("--moe-router-topk", type=positive_int, default=2,
                   help="experts each token is routed to. Default: %(default)s")
    g.add_argument("--moe-router-load-balancing-type", nargs="+", choices=LOAD_BALANCING, default="aux_loss",
                   help="the router's load balancing; several types add up (one --moe-aux-loss-coeff each). "
                        "Default: %(default)s")
    g.add_argument("--moe-aux-loss-coeff", nargs="+", type=non_negative_float, default=0.0,
                   help="weight of the load-balancing loss, one per --moe-router-load-balancing-type. "
                        "Default: %(default)s")
    g.add_argument("--moe-z-loss-coeff", type=non_negative_float, default=None,
                   help="weight of the router's z-loss, which keeps its logits small. Default: none")
    g.add_argument("--moe-input-jitter-eps", type=non_negative_float, default=None,
                   help="multiply the router's input by uniform noise in [1-eps, 1+eps]. Default: none")
    g.add_argument("--moe-router-dtype", choices=["fp32", "fp64"], default=None,
                   help="the router's logits and probabilities in this precision (default the model's)")
    g.add_argument("--moe-router-score-function", choices=["softmax", "sigmoid"], default="softmax",
                   help="softmax or sigmoid of the router's logits. Default: %(default)s")
    g.add_argument("--moe-router-pre-softmax", action="store_true",
                   help="softmax over all experts before the top-k (default: over the top-k chosen)")
    g.add_argument("--moe-router-topk-scaling-factor", type=finite, default=None,
                   help="with --moe-router-pre-softmax: multiply the top-k scores by this. Default: none")
    g.add_argument("--moe-router-num-groups", type=positive_int, default=None,
                   help="group-limited routing: the experts form N groups (with --moe-router-group-topk)")
    g.add_argument("--moe-router-group-topk", type=positive_int, default=None,
                   help="group-limited routing: groups a token's experts may come from")
    g.add_argument("--moe-router-enable-expert-bias", action="store_true",
                   help="aux-loss-free balancing: a per-expert bias learnt from the load steers top-k (sigmoid only)")
    g.add_argument("--moe-router-bias-update-rate", type=non_negative_float, default=1e-3,
                   help="with --moe-router-enable-expert-bias: the bias step per global batch. Default: %(default)s")
    g.add_argument("--moe-token-dispatcher-type", choices=["allgather", "alltoall", "flex"], default="allgather",
                   help="how tokens reach their experts' ranks; flex is refused (needs DeepEP or HybridEP). "
                        "Default: %(default)s")
    g.add_argument("--moe-expert-capacity-factor", type=non_negative_float, default=None,
                   help="an expert takes at most this x its even share of tokens and drops the rest. "
                        "Default: none, no dropping")
    g.add_argument("--moe-pad-expert-input-to-capacity", action="store_true",
                   help="with --moe-expert-capacity-factor: pad each expert's input to its capacity (alltoall)")
    g.add_argument("--moe-token-drop-policy", choices=["probs", "position"], default="probs",
                   help="over capacity, drop the tokens of lowest probability (probs) or the last ones (position). "
                        "Default: %(default)s")
    g.add_argument("--moe-grouped-gemm", action="store_true",
                   help="one grouped GEMM for a rank's experts (grouped_gemm or transformer-engine); "
                        "without them megatron-core's sequential experts, same arithmetic")
    g.add_argument("--moe-permute-fusion", action="store_true",
                   help="transformer-engine's fused kernels for the tokens' permutation to their experts and back "
                        "(refused where transformer-engine is not installed)")
    g.add_argument("--moe-per-layer-logging", action="store_true", help="also log each MoE layer's aux losses")
    g.add_argument("--moe-layer-recompute", action="store_true",
                   help="recompute the MoE layers in backward (megatron-core: selective; not with full recompute)")
    g.add_argument("--expert-model-parallel-size", type=positive_int, default=1,
                   help="ranks the experts are spread over; must divide --num-experts. Default: %(default)s")
    g.add_argument("--expert-tensor-parallel-size", type=positive_int, default=None,
                   help="tensor parallelism inside each expert (default --tensor-model-parallel-size)")


def validate(parser, args) -> None:
    """Megatron-LM's derivations and checks; sizes that need the world size are checked at start-up
    (``check_world``)."""
    if args.num_experts == 0:
        args.num_experts = None
    for name in ("moe_router_load_balancing_type", "moe_aux_loss_coeff"):  # one entry: a plain value, as upstream
        value = getattr(args, name)
        if isinstance(value, list) and len(value) == 1:
            setattr(args, name, value[0])
    if args.expert_tensor_parallel_size is None:
        args.expert_tensor_parallel_size = args.tensor_model_parallel_size
    if args.num_experts is None:
        for flag, given in (("--expert-model-parallel-size", args.expert_model_parallel_size > 1),
                            ("--moe-grouped-gemm", args.moe_grouped_gemm),
                            ("--moe-permute-fusion", args.moe_permute_fusion),
                            ("--moe-ffn-hidden-size", args.moe_ffn_hidden_size is not None),
                            ("--moe-shared-expert-intermediate-size",
                             args.moe_shared_expert_intermediate_size is not None)):
            if given:
                parser.error(f"argument {flag}: requires --num-experts N (a mixture-of-experts model)")
        args.moe_grouped_gemm_kernel = None
        return
    if args.moe_ffn_hidden_size is None:
        args.moe_ffn_hidden_size = args.ffn_hidden_size  # as Megatron-LM (it warns likewise)
    experts, ep = args.num_experts, args.expert_model_parallel_size
    if experts % ep:
        parser.error(f"argument --expert-model-parallel-size: {ep} must divide --num-experts {experts}")
    if args.moe_router_topk > experts:
        parser.error(f"argument --moe-router-topk: {args.moe_router_topk} exceeds --num-experts {experts}")
    if args.moe_router_topk == 1 and args.moe_router_score_function == "softmax" and not args.moe_router_pre_softmax \
            and args.moe_router_load_balancing_type != "sinkhorn":
        # megatron-core refuses it: a softmax over one selected logit has a zero gradient
        parser.error("argument --moe-router-topk 1: needs --moe-router-pre-softmax (or --moe-router-score-function "
                     "sigmoid, or sinkhorn load balancing)")
    pattern = moe_layers(args.num_layers, args.moe_layer_freq)
    if isinstance(args.moe_layer_freq, list) and len(pattern) != args.num_layers:
        parser.error(f"argument --moe-layer-freq: the pattern has {len(pattern)} entries, "
                     f"--num-layers is {args.num_layers}")
    _check_loss_types(parser, args)
    if args.moe_token_dispatcher_type == "flex":
        parser.error("argument --moe-token-dispatcher-type flex: needs DeepEP or HybridEP on CUDA, "
                     "not installed here; use alltoall or allgather")
    if args.moe_expert_capacity_factor is not None and args.moe_token_dispatcher_type == "allgather" \
            and args.moe_pad_expert_input_to_capacity:
        parser.error("argument --moe-pad-expert-input-to-capacity: needs --moe-token-dispatcher-type alltoall")
    if args.tensor_model_parallel_size > 1 and not args.sequence_parallel:
        # megatron-core's MoE layer refuses to train under TP without sequence parallelism
        parser.error(f"argument --tensor-model-parallel-size {args.tensor_model_parallel_size}: megatron-core's MoE "
                     "layers need --sequence-parallel with tensor parallelism (and it, transformer-engine layers)")
    if (args.moe_router_num_groups is None) != (args.moe_router_group_topk is None):
        parser.error("argument --moe-router-group-topk: give it together with --moe-router-num-groups")
    if args.moe_permute_fusion and not _installed("transformer_engine"):
        parser.error("argument --moe-permute-fusion: needs transformer-engine's fused permute kernels, not installed "
                     "here; without the flag megatron-core permutes the tokens unfused")
    args.moe_grouped_gemm_kernel = _grouped_gemm_kernel(args) if args.moe_grouped_gemm else None


def _installed(module: str) -> bool:
    from megatron.training.model.kernels import installed

    return installed(module)


def _check_loss_types(parser, args) -> None:
    types = args.moe_router_load_balancing_type
    coeffs = args.moe_aux_loss_coeff
    if isinstance(types, list) and (not isinstance(coeffs, list) or len(coeffs) != len(types)):
        given = len(coeffs) if isinstance(coeffs, list) else 1
        parser.error(f"argument --moe-aux-loss-coeff: {given} value(s) for {len(types)} "
                     f"--moe-router-load-balancing-type entries; give one per type")
    if isinstance(coeffs, list) and not isinstance(types, list):
        parser.error(f"argument --moe-aux-loss-coeff: {len(coeffs)} values for one --moe-router-load-balancing-type")


def _grouped_gemm_kernel(args) -> str:
    """Which grouped GEMM runs: 'te' (transformer-engine layers), 'grouped_gemm', or 'sequential'."""
    if args.transformer_impl == "transformer_engine":
        return "te"
    if _installed("grouped_gemm") and getattr(args, "device", "auto") != "cpu":
        return "grouped_gemm"
    return "sequential"


def check_world(args, world: int) -> None:
    """Megatron-core's expert grid: TP x PP x CP x DP = ETP x EP x PP x EDP = the world (raises UserError)."""
    from megatron.training.errors import UserError

    if args.num_experts is None:
        return
    pp, ep, etp = args.pipeline_model_parallel_size, args.expert_model_parallel_size, args.expert_tensor_parallel_size
    if world % (etp * ep * pp):
        raise UserError(f"--expert-model-parallel-size/--expert-tensor-parallel-size: ETP x EP x PP = "
                        f"{etp} x {ep} x {pp} = {etp * ep * pp} does not divide the world size {world}")
