"""One model shape for every system of the offload comparison, and its parameter count.

The same numbers feed our pretrain_gpt.py flags and the Hugging Face LlamaConfig, so both build
the same network: untied embeddings, no biases, RMSNorm, SwiGLU, RoPE, GQA.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass


@dataclass(frozen=True)
class LlamaShape:
    layers: int
    hidden: int
    ffn: int
    heads: int
    kv_heads: int
    vocab: int
    seq: int

    def __post_init__(self):
        if self.hidden % self.heads or self.heads % self.kv_heads:
            raise ValueError(f"heads must divide hidden and kv_heads must divide heads: {self}")

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads

    def num_params(self) -> int:
        """Both implementations: embedding + output layer, per layer QKV/O, SwiGLU (3 matrices), 2 norms."""
        h, kv = self.hidden, self.kv_heads * self.head_dim
        attn = h * h + 2 * h * kv + h * h
        mlp = 3 * h * self.ffn
        per_layer = attn + mlp + 2 * h
        return 2 * self.vocab * h + self.layers * per_layer + h

    def megatron_flags(self) -> list:
        return ["--num-layers", str(self.layers), "--hidden-size", str(self.hidden),
                "--ffn-hidden-size", str(self.ffn), "--num-attention-heads", str(self.heads),
                "--group-query-attention", "--num-query-groups", str(self.kv_heads), "--vocab-size", str(self.vocab),
                "--seq-length", str(self.seq), "--max-position-embeddings", str(self.seq),
                "--swiglu", "--normalization", "RMSNorm", "--position-embedding-type", "rope",
                "--untie-embeddings-and-output-weights", "--disable-bias-linear",
                "--hidden-dropout", "0", "--attention-dropout", "0",
                "--use-distributed-optimizer"]  # the baseline the offload is compared with

    def peer_flags(self) -> list:
        return ["--layers", str(self.layers), "--hidden", str(self.hidden), "--ffn", str(self.ffn),
                "--heads", str(self.heads), "--kv-heads", str(self.kv_heads), "--vocab", str(self.vocab),
                "--seq", str(self.seq)]

    def as_dict(self) -> dict:
        return {**asdict(self), "params": self.num_params()}


def add_shape_flags(parser, defaults: LlamaShape) -> None:
    for name in ("layers", "hidden", "ffn", "heads", "kv_heads", "vocab", "seq"):
        parser.add_argument("--" + name.replace("_", "-"), type=int, default=getattr(defaults, name))


def shape_from_args(args) -> LlamaShape:
    return LlamaShape(args.layers, args.hidden, args.ffn, args.heads, args.kv_heads, args.vocab, args.seq)
