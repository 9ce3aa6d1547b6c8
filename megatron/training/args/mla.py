"""Megatron-LM's multi-latent attention flags (DeepSeek-V2/V3), with its defaults and checks.

The attention is megatron-core's own (``MLATransformerConfig`` and the MLA layer spec,
``model.configs.mla_fields``): queries (optionally through a low-rank ``--q-lora-rank``) and a
compressed key-value latent of ``--kv-lora-rank`` that up-projects to ``--qk-head-dim`` keys and
``--v-head-dim`` values per head, with ``--qk-pos-emb-head-dim`` of each query and the shared key
rotated by RoPE (YaRN unless ``--rope-type rope``). What only serves inference or needs a kernel
this process lacks is refused in one line.
"""

from __future__ import annotations

import argparse

from megatron.training.errors import finite, non_negative_float, positive_float, positive_int


def add_flags(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("multi-latent attention (Megatron-LM; megatron-core's MLA layers)")
    g.add_argument("--multi-latent-attention", action="store_true",
                   help="DeepSeek-V2/V3 attention: low-rank compressed queries and keys/values")
    g.add_argument("--q-lora-rank", type=positive_int, default=None,
                   help="rank of the queries' low-rank projection (default none: one full projection)")
    g.add_argument("--kv-lora-rank", type=positive_int, default=32, help="rank of the key-value latent")
    g.add_argument("--qk-head-dim", type=positive_int, default=128, help="per-head query/key width without RoPE")
    g.add_argument("--qk-pos-emb-head-dim", type=positive_int, default=64, help="per-head width RoPE rotates")
    g.add_argument("--v-head-dim", type=positive_int, default=128, help="per-head value width")
    g.add_argument("--rotary-scaling-factor", type=positive_float, default=1.0,
                   help="YaRN's context extension factor (MLA, or --position-embedding-type yarn)")
    g.add_argument("--mscale", type=finite, default=1.0, help="YaRN's attention-scale coefficient")
    g.add_argument("--mscale-all-dim", type=non_negative_float, default=0.0,
                   help="YaRN's attention-scale coefficient over all dimensions")
    g.add_argument("--cache-mla-latents", action="store_true",
                   help="not supported: an inference cache (Flash MLA decoding)")
    g.add_argument("--mla-down-proj-fusion", action="store_true",
                   help="not supported: a fused down projection absent from megatron-core 0.16.1")


def validate(parser, args) -> None:
    """Megatron-LM's checks; runs after the core and kernel checks (the attention backend is known)."""
    if not args.multi_latent_attention:
        for flag, given in (("--cache-mla-latents", args.cache_mla_latents),
                            ("--mla-down-proj-fusion", args.mla_down_proj_fusion)):
            if given:
                parser.error(f"argument {flag}: requires --multi-latent-attention")
        if args.rope_type == "yarn":
            parser.error("argument --rope-type yarn: only with --multi-latent-attention (Megatron-LM's other "
                         "attention takes rope; --position-embedding-type yarn is YaRN for it)")
        return
    if args.group_query_attention:
        parser.error("argument --multi-latent-attention: not allowed with --group-query-attention")
    if args.cache_mla_latents:
        parser.error("argument --cache-mla-latents: caches latents for Flash MLA decoding (inference), "
                     "not for training; drop it")
    if args.mla_down_proj_fusion:
        parser.error("argument --mla-down-proj-fusion: needs a fused MLA down projection that megatron-core "
                     "0.16.1 lacks; drop it (the unfused projections compute the same)")
    if args.rotary_interleaved:
        parser.error("argument --rotary-interleaved: megatron-core's MLA rotates halves, not interleaved pairs; "
                     "drop it with --multi-latent-attention")
