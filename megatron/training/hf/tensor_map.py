"""Each of megatron-core's tensors (per layer and expert, whole, as its checkpoint's global form holds
them) made of which Hugging Face tensors, and how, both ways:

- QKV: megatron-core keeps one matrix, per query group its heads' queries, then the group's key, then
  its value; Hugging Face keeps q_proj, k_proj and v_proj;
- SwiGLU's first layer: [gate; up] in one matrix, gate_proj and up_proj (Mixtral's w1 and w3);
- DeepSeek-V2's RoPE dimensions: as they are (Hugging Face rotates interleaved pairs; megatron-core's
  MLA takes its RoPE input's even then odd elements before rotating halves, the same rotation);
- the embedding and output rows past the tokenizer's vocabulary are padding (zeros in, dropped out);
- norms and the rest: the same tensor under another name.
"""

from __future__ import annotations

from typing import Callable, Dict, List, Optional, Tuple

import torch

from megatron.training.hf.families import ModelShape

Tensors = Dict[str, torch.Tensor]
# megatron-core names a layer's norms after the linear layer they are fused into with transformer-engine
# layers; its local layers' keys map onto those, except in MLA layers: both spellings map.
_SAME = {
    "self_attention.linear_qkv.layer_norm_weight": "input_layernorm.weight",
    "input_layernorm.weight": "input_layernorm.weight",
    "mlp.linear_fc1.layer_norm_weight": "post_attention_layernorm.weight",
    "pre_mlp_layernorm.weight": "post_attention_layernorm.weight",
    "self_attention.linear_proj.weight": "self_attn.o_proj.weight",
    "self_attention.q_layernorm.weight": "self_attn.q_norm.weight",
    "self_attention.k_layernorm.weight": "self_attn.k_norm.weight",
    "mlp.linear_fc2.weight": "mlp.down_proj.weight",
    "mlp.router.weight": "mlp.gate.weight",
    "mlp.shared_experts.linear_fc2.weight": "mlp.shared_experts.down_proj.weight",
    # multi-latent attention
    "self_attention.linear_q_down_proj.weight": "self_attn.q_a_proj.weight",
    "self_attention.linear_q_up_proj.layer_norm_weight": "self_attn.q_a_layernorm.weight",
    "self_attention.kv_layernorm.weight": "self_attn.kv_a_layernorm.weight",
    "self_attention.linear_kv_up_proj.layer_norm_weight": "self_attn.kv_a_layernorm.weight",
    "self_attention.linear_kv_up_proj.weight": "self_attn.kv_b_proj.weight",
}
_MLA_SAME = {
    "self_attention.linear_q_proj.weight": "self_attn.q_proj.weight",
    "self_attention.linear_q_up_proj.weight": "self_attn.q_b_proj.weight",
    "self_attention.linear_kv_down_proj.weight": "self_attn.kv_a_proj_with_mqa.weight",
}
_GLOBAL = {"decoder.final_layernorm.weight": "model.norm.weight"}
_PADDED = {"embedding.word_embeddings.weight": "model.embed_tokens.weight", "output_layer.weight": "lm_head.weight"}


class UnmappedTensor(KeyError):
    """A tensor of ours that has no Hugging Face counterpart in this family."""


class TensorMap:
    """Our tensors <-> Hugging Face's, for one model (``ModelShape``)."""

    def __init__(self, shape: ModelShape):
        self.shape = shape

    # -- which tensors ----------------------------------------------------------------------------
    def hf_names(self, name: str, layer: Optional[int] = None, expert: Optional[int] = None) -> List[str]:
        """The Hugging Face tensors that ``name`` (of ``layer`` and ``expert``) is made of."""
        return list(self._rule(name, layer, expert)[0])

    def _rule(self, name: str, layer, expert) -> Tuple[List[str], Callable, Callable]:
        """(Hugging Face names, join: their tensors -> ours, split: ours -> their tensors)."""
        same = (lambda ts: ts[0], lambda t: [t])
        if name in _GLOBAL:
            return [_GLOBAL[name]], *same
        if name in _PADDED:
            return [_PADDED[name]], self._pad_rows, self._unpad_rows
        layer_prefix = f"model.layers.{layer}."
        mixtral = self.shape.family == "mixtral"
        if mixtral and name == "mlp.router.weight":
            return [layer_prefix + "block_sparse_moe.gate.weight"], *same
        if name in _SAME:
            return [layer_prefix + _SAME[name]], *same
        if name == "self_attention.linear_qkv.weight":
            names = [layer_prefix + f"self_attn.{p}_proj.weight" for p in "qkv"]
            return names, self._join_qkv, self._split_qkv
        if name == "self_attention.linear_qkv.bias":
            names = [layer_prefix + f"self_attn.{p}_proj.bias" for p in "qkv"]
            return names, self._join_qkv, self._split_qkv
        if name == "mlp.linear_fc1.weight":
            return [layer_prefix + "mlp.gate_proj.weight", layer_prefix + "mlp.up_proj.weight"], _cat, self._halves
        if name == "mlp.shared_experts.linear_fc1.weight":
            shared = layer_prefix + "mlp.shared_experts."
            names = [shared + "gate_proj.weight", shared + "up_proj.weight"]
            return names, _cat, self._halves
        if name.startswith("mlp.experts.experts."):
            return self._expert_rule(name, layer_prefix, expert)
        if name in _MLA_SAME:
            return [layer_prefix + _MLA_SAME[name]], *same
        if name == "self_attention.q_layernorm.weight" and self.shape.mla:
            return [layer_prefix + "self_attn.q_a_layernorm.weight"], *same
        raise UnmappedTensor(f"{name} has no {self.shape.family} counterpart")

    def _expert_rule(self, name: str, layer_prefix: str, expert: int):
        if self.shape.family == "mixtral":
            base = f"{layer_prefix}block_sparse_moe.experts.{expert}."
            gate, up, down = base + "w1.weight", base + "w3.weight", base + "w2.weight"
        else:
            base = f"{layer_prefix}mlp.experts.{expert}."
            gate, up, down = base + "gate_proj.weight", base + "up_proj.weight", base + "down_proj.weight"
        if name.endswith("linear_fc1.weight"):
            return [gate, up], _cat, self._halves
        if name.endswith("linear_fc2.weight"):
            return [down], lambda ts: ts[0], lambda t: [t]
        raise UnmappedTensor(f"{name} has no {self.shape.family} counterpart")

    # -- both directions ---------------------------------------------------------------------------
    def to_ours(self, name: str, layer, expert, read: Callable[[str], torch.Tensor]) -> torch.Tensor:
        """Ours, whole for its layer and expert, from the Hugging Face tensors ``read`` returns."""
        names, join, _ = self._rule(name, layer, expert)
        return join([read(n) for n in names])

    def to_hf(self, name: str, layer, expert, ours: torch.Tensor) -> Tensors:
        names, _, split = self._rule(name, layer, expert)
        return {n: t.contiguous() for n, t in zip(names, split(ours))}

    # -- the transforms ----------------------------------------------------------------------------
    def _pad_rows(self, ts):
        t = ts[0]
        if t.shape[0] == self.shape.padded_vocab:
            return t
        padded = t.new_zeros((self.shape.padded_vocab, *t.shape[1:]))
        padded[: t.shape[0]] = t
        return padded

    def _unpad_rows(self, t):
        return [t[: self.shape.vocab]]

    def _join_qkv(self, ts):
        q, k, v = ts
        groups, d = self.shape.groups, self.shape.head_dim
        tail = q.shape[1:]
        parts = [q.reshape(groups, -1, *tail), k.reshape(groups, d, *tail), v.reshape(groups, d, *tail)]
        return torch.cat(parts, dim=1).reshape(-1, *tail)

    def _split_qkv(self, t):
        groups, d = self.shape.groups, self.shape.head_dim
        per_group = self.shape.heads // groups * d
        tail = t.shape[1:]
        q, k, v = t.reshape(groups, per_group + 2 * d, *tail).split([per_group, d, d], dim=1)
        return [q.reshape(-1, *tail), k.reshape(-1, *tail), v.reshape(-1, *tail)]

    @staticmethod
    def _halves(t):
        return list(t.chunk(2, dim=0))


def _cat(ts):
    return torch.cat(ts, dim=0)
