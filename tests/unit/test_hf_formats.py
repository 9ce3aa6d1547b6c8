"""The Hugging Face tensor map and the two file formats, as properties over random shapes:

- our fused tensors hold Hugging Face's in megatron-core's order (QKV per query group, written out
  here group by group; [gate; up]), and Hugging Face's come back bit for bit from ours;
- safetensors files written here are read by the safetensors library, and files it writes are read
  here, over dtypes, shapes and shard sizes;
- a torch_dist checkpoint written here loads through torch.distributed.checkpoint's own reader, and
  any region read back here equals the tensor it was cut from, over chunk grids.
"""

import os

import pytest
import torch
from hypothesis import given, settings, strategies as st

from megatron.training.hf.families import ModelShape
from megatron.training.hf.files import SafetensorsReader, SafetensorsWriter, TorchDistReader, TorchDistWriter
from megatron.training.hf.tensor_map import TensorMap
from tests.profiles import examples

DTYPES = [torch.float32, torch.bfloat16, torch.float16]


@st.composite
def model_shapes(draw):
    groups = draw(st.sampled_from([1, 2, 4]))
    heads = groups * draw(st.sampled_from([1, 2, 3]))
    family = draw(st.sampled_from(["llama", "qwen2", "mixtral", "qwen3_moe", "deepseek_v2"]))
    return ModelShape(family=family, layers=2, hidden=draw(st.sampled_from([8, 12])), heads=heads, groups=groups,
                      head_dim=draw(st.sampled_from([2, 4, 6])), ffn=draw(st.sampled_from([4, 10])), vocab=10,
                      padded_vocab=draw(st.sampled_from([10, 16])), tied=False, experts=3,
                      kv_lora_rank=4, qk_nope_dim=4, qk_rope_dim=2, v_head_dim=4)


def names_of(shape):
    names = ["embedding.word_embeddings.weight", "output_layer.weight", "decoder.final_layernorm.weight",
             "self_attention.linear_qkv.layer_norm_weight", "self_attention.linear_proj.weight",
             "mlp.linear_fc1.weight", "mlp.linear_fc2.weight", "pre_mlp_layernorm.weight"]
    if shape.family == "deepseek_v2":
        names = [n for n in names if "linear_qkv" not in n]
        names += ["self_attention.linear_q_proj.weight", "self_attention.linear_kv_down_proj.weight",
                  "self_attention.kv_layernorm.weight", "self_attention.linear_kv_up_proj.weight",
                  "mlp.shared_experts.linear_fc1.weight"]
    else:
        names += ["self_attention.linear_qkv.weight", "self_attention.linear_qkv.bias"]
    if shape.experts:
        names += ["mlp.router.weight", "mlp.experts.experts.linear_fc1.weight", "mlp.experts.experts.linear_fc2.weight"]
    return names


@settings(max_examples=examples(60), deadline=None)
@given(shape=model_shapes(), layer=st.integers(0, 1), expert=st.integers(0, 2), seed=st.integers(0, 2**16))
def test_hugging_face_tensors_come_back_bit_for_bit(shape, layer, expert, seed):
    tmap = TensorMap(shape)
    gen = torch.Generator().manual_seed(seed)
    for name in names_of(shape):
        hf_names = tmap.hf_names(name, layer, expert)
        sizes = {n: (shape.vocab if "embed" in n or "lm_head" in n else 6, 5) for n in hf_names}
        if name == "self_attention.linear_qkv.weight" or name == "self_attention.linear_qkv.bias":
            tail = (shape.hidden,) if name.endswith("weight") else ()
            sizes = {hf_names[0]: (shape.heads * shape.head_dim, *tail),
                     hf_names[1]: (shape.groups * shape.head_dim, *tail),
                     hf_names[2]: (shape.groups * shape.head_dim, *tail)}
        original = {n: torch.randn(s, generator=gen) for n, s in sizes.items()}
        ours = tmap.to_ours(name, layer, expert, original.__getitem__)
        back = tmap.to_hf(name, layer, expert, ours)
        assert sorted(back) == sorted(original), name
        for n, t in original.items():
            assert torch.equal(back[n], t), (name, n)


@settings(max_examples=examples(30), deadline=None)
@given(shape=model_shapes(), seed=st.integers(0, 2**16))
def test_qkv_is_megatron_core_order(shape, seed):
    """Per query group: its heads' queries, the group's key, its value (megatron-core's SelfAttention
    reads it so); written out group by group, independent of the reshapes the map uses."""
    gen = torch.Generator().manual_seed(seed)
    d, per_group = shape.head_dim, shape.heads // shape.groups
    q = torch.randn(shape.heads * d, shape.hidden, generator=gen)
    k = torch.randn(shape.groups * d, shape.hidden, generator=gen)
    v = torch.randn(shape.groups * d, shape.hidden, generator=gen)
    expected = []
    for g in range(shape.groups):
        expected += [q[g * per_group * d:(g + 1) * per_group * d], k[g * d:(g + 1) * d], v[g * d:(g + 1) * d]]
    hf = {"model.layers.0.self_attn.q_proj.weight": q, "model.layers.0.self_attn.k_proj.weight": k,
          "model.layers.0.self_attn.v_proj.weight": v}
    ours = TensorMap(shape).to_ours("self_attention.linear_qkv.weight", 0, None, hf.__getitem__)
    assert torch.equal(ours, torch.cat(expected))
    halves = {"model.layers.1.mlp.gate_proj.weight": q, "model.layers.1.mlp.up_proj.weight": k}
    fc1 = TensorMap(shape).to_ours("mlp.linear_fc1.weight", 1, None, halves.__getitem__)
    assert torch.equal(fc1, torch.cat([q, k]))


tensor_dicts = st.dictionaries(
    st.text("abcdefgh.", min_size=1, max_size=8),
    st.tuples(st.sampled_from(DTYPES), st.lists(st.integers(0, 5), min_size=0, max_size=3)), min_size=1, max_size=6)


@settings(max_examples=examples(40), deadline=None)
@given(specs=tensor_dicts, shard_bytes=st.sampled_from([1, 64, 10**9]), seed=st.integers(0, 2**16))
def test_safetensors_written_here_are_read_by_the_library_and_back(tmp_path_factory, specs, shard_bytes, seed):
    from safetensors import safe_open
    from safetensors.torch import save_file

    gen = torch.Generator().manual_seed(seed)
    tensors = {n: torch.randn(shape, generator=gen).to(dtype) for n, (dtype, shape) in specs.items()}
    out = tmp_path_factory.mktemp("st")
    writer = SafetensorsWriter(str(out), {n: (t.dtype, t.shape) for n, t in tensors.items()}, shard_bytes)
    for n, t in tensors.items():
        writer.write(n, t)
    writer.close()
    files = [f for f in os.listdir(out) if f.endswith(".safetensors")]
    assert (len(files) > 1) == os.path.exists(out / "model.safetensors.index.json")
    read = {}
    for f in files:
        with safe_open(str(out / f), "pt") as handle:
            read.update({k: handle.get_tensor(k) for k in handle.keys()})
    assert sorted(read) == sorted(tensors)
    assert all(read[n].dtype == t.dtype and torch.equal(read[n], t) for n, t in tensors.items())
    theirs = tmp_path_factory.mktemp("st_lib")
    save_file(tensors, str(theirs / "model.safetensors"))
    reader = SafetensorsReader(str(theirs))
    assert all(torch.equal(reader.read(n), t) for n, t in tensors.items())
    reader.close()


@settings(max_examples=examples(30), deadline=None)
@given(rows=st.integers(1, 3), cols=st.integers(1, 3), seed=st.integers(0, 2**16), dtype=st.sampled_from(DTYPES),
       region=st.tuples(st.integers(0, 5), st.integers(0, 5), st.integers(1, 6), st.integers(1, 6)))
def test_torch_dist_written_here_loads_in_torch_and_reads_back(tmp_path_factory, rows, cols, seed, dtype, region):
    """A 6 x 6 tensor saved as a rows x cols grid of chunks (and an object): DCP's loader reads it
    whole, this reader any region of it."""
    import torch.distributed.checkpoint as dcp

    full = torch.randn(6, 6, generator=torch.Generator().manual_seed(seed)).to(dtype)
    path = tmp_path_factory.mktemp("td")
    writer = TorchDistWriter(str(path))
    row_cuts, col_cuts = _cuts(6, rows), _cuts(6, cols)
    for r0, r1 in zip(row_cuts, row_cuts[1:]):
        for c0, c1 in zip(col_cuts, col_cuts[1:]):
            writer.add_tensor("w", (6, 6), (r0, c0), full[r0:r1, c0:c1])
    writer.add_object("extra/shard_0_1", {"a": 1})
    writer.close({"iteration": 0})
    loaded = {"w": torch.zeros(6, 6, dtype=dtype)}
    dcp.load(loaded, checkpoint_id=str(path), no_dist=True)
    assert torch.equal(loaded["w"], full)
    r, c, h, w = region
    h, w = min(h, 6 - r), min(w, 6 - c)
    reader = TorchDistReader(str(path))
    assert torch.equal(reader.read("w", (r, c), (h, w)), full[r:r + h, c:c + w])
    reader.close()


def _cuts(n, parts):
    return sorted({0, n, *[n * i // parts for i in range(1, parts)]})


@pytest.mark.parametrize("padded", [10, 16])
def test_padding_rows_are_zero_in_and_dropped_out(padded):
    shape = ModelShape("llama", 1, 4, 2, 2, 2, 4, vocab=10, padded_vocab=padded, tied=False)
    tmap = TensorMap(shape)
    embed = torch.randn(10, 4)
    hf = {"model.embed_tokens.weight": embed}
    ours = tmap.to_ours("embedding.word_embeddings.weight", None, None, hf.__getitem__)
    assert ours.shape == (padded, 4) and torch.equal(ours[:10], embed) and not ours[10:].any()
    assert torch.equal(tmap.to_hf("output_layer.weight", None, None, ours)["lm_head.weight"], embed)
