"""tools/hf_checkpoint.py against transformers itself: tiny random models of every family built by
transformers from a config (offline), imported; our forward (pretrain_gpt.py's model, the training
layer's loader, megatron-core's schedule, fp32 on CPU) against transformers' forward on the same
tokens at TP1 and at TP2 x PP2 (MoE families: EP2 x PP2, megatron-core's MoE takes no TP on CPU);
the export of an import bit-identical tensor for tensor (read back by the safetensors library); a
fine-tuning from an import (the imported tokenizer through preprocess_data.py, offloaded optimizer
state) exported and loaded by transformers, whose logits match ours; refusals in one line with
nothing written. One 4-rank launch computes every forward of ours."""

import argparse
import json
import math
import os

import pytest
import torch

pytest.importorskip("transformers")
pytest.importorskip("safetensors")

from helpers import offload_args  # noqa: E402
from launch import REPO, launch_command, losses, pretrain_env, run_and_clean_up, run_pretrain  # noqa: E402
from tests.profiles import PROFILE  # noqa: E402

from megatron.training.hf import convert  # noqa: E402

HF_FORWARD = REPO / "tests" / "integration" / "hf_forward.py"
SMALL = dict(vocab_size=96, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
             intermediate_size=96, max_position_embeddings=128)  # 96 tokens: the import pads to 128 rows
MOE = dict(num_experts_per_tok=2, moe_intermediate_size=32)
LLAMA3_ROPE = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}
DEEPSEEK_YARN = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 4096,
                 "beta_fast": 32, "beta_slow": 1, "mscale": 0.707, "mscale_all_dim": 0.707}
# name -> (transformers config class, its arguments)
FAMILIES = {
    "llama3": ("LlamaConfig", dict(SMALL, rope_parameters=LLAMA3_ROPE)),
    "llama3_tied": ("LlamaConfig", dict(SMALL, tie_word_embeddings=True)),  # Llama 3.2 1B/3B's form
    "mistral": ("MistralConfig", dict(SMALL, sliding_window=None)),
    "qwen2": ("Qwen2Config", SMALL),
    "qwen3": ("Qwen3Config", dict(SMALL, head_dim=24)),  # head_dim apart from hidden / heads, as Qwen3's
    "mixtral": ("MixtralConfig", dict(SMALL, num_local_experts=4, num_experts_per_tok=2)),
    "qwen3_moe": ("Qwen3MoeConfig", dict(SMALL, num_experts=4, norm_topk_prob=True, **MOE)),
    "deepseek_v2": ("DeepseekV2Config", dict(SMALL, num_key_value_heads=4, n_routed_experts=4, n_shared_experts=1,
                                             first_k_dense_replace=1, kv_lora_rank=32, q_lora_rank=None,
                                             qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16,
                                             rope_parameters=DEEPSEEK_YARN, **MOE)),
}
MOE_FAMILIES = {"mixtral", "qwen3_moe", "deepseek_v2"}
TOKENS = (2, 16)  # batch, sequence
FINETUNE_ITERS = 3


def layouts(family):
    """TP:PP:EP layouts our forward runs at: TP1 and a split one; under the thorough profile also each
    parallelism alone (EP4 for MoE)."""
    split = ["1:2:2"] if family in MOE_FAMILIES else ["2:2:1"]
    more = (["1:1:2", "1:1:4"] if family in MOE_FAMILIES else ["2:1:1", "1:2:1"]) if PROFILE == "thorough" else []
    return ["1:1:1", *split, *more]


def build_hf_model(name, directory):
    import transformers

    config_class, kwargs = FAMILIES[name]
    torch.manual_seed(sorted(FAMILIES).index(name))
    model = transformers.AutoModelForCausalLM.from_config(getattr(transformers, config_class)(**kwargs))
    model.save_pretrained(directory)
    return directory


def hf_logits(hf_dir, tokens):
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        return model(tokens).logits


def tiny_tokenizer(directory, texts):
    """A word-level tokenizer of at most the models' 96 tokens, saved as transformers saves one."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.WordLevel(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.train_from_iterator(texts, trainers.WordLevelTrainer(vocab_size=96, special_tokens=["<unk>", "<eos>"]))
    PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", eos_token="<eos>").save_pretrained(directory)


@pytest.fixture(scope="module")
def work(tmp_path_factory):
    return tmp_path_factory.mktemp("hf")


@pytest.fixture(scope="module")
def corpus(work):
    lines = (REPO / "examples" / "data" / "corpus.jsonl").read_text().splitlines()[:40]
    texts = [json.loads(line)["text"] for line in lines]
    path = work / "corpus.jsonl"
    path.write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
    return path, texts


@pytest.fixture(scope="module")
def imported(work, corpus):
    """family -> (Hugging Face directory, our checkpoint directory)."""
    out = {}
    for name in FAMILIES:
        hf_dir = build_hf_model(name, work / f"hf_{name}")
        if name == "llama3":
            tiny_tokenizer(hf_dir, corpus[1])
        convert.import_checkpoint(str(hf_dir), str(work / f"ckpt_{name}"))
        out[name] = hf_dir, work / f"ckpt_{name}"
    return out


@pytest.fixture(scope="module")
def tokens():
    return torch.randint(0, SMALL["vocab_size"], TOKENS, generator=torch.Generator().manual_seed(5))


@pytest.fixture(scope="module")
def finetuned(work, imported, corpus):
    """The llama3 import fine-tuned FINETUNE_ITERS iterations on the corpus, tokenized by the import's
    own tokenizer files; TP2, offloaded optimizer state on the host tier. -> (run dir, records)."""
    import importlib.util
    import sys

    _, ckpt = imported["llama3"]
    tokenizer = ["--tokenizer-type", "HuggingFaceTokenizer", "--tokenizer-model", str(ckpt / "hf")]
    spec = importlib.util.spec_from_file_location("preprocess_data", REPO / "tools" / "preprocess_data.py")
    tool = sys.modules["preprocess_data"] = importlib.util.module_from_spec(spec)  # its pool pickles by name
    spec.loader.exec_module(tool)
    assert tool.main(["--input", str(corpus[0]), "--output-prefix", str(work / "corpus"), *tokenizer,
                      "--append-eod"]) == 0
    run = work / "finetune"
    model_args = (ckpt / convert.MODEL_ARGS).read_text().split()
    records = run_pretrain(run, [*tokenizer, "--finetune", "--load", str(ckpt), "--save", str(run / "ckpt"),
                                 "--data-path", str(work / "corpus_text_document"), "--split", "1,0,0",
                                 "--eval-iters", "0", "--data-cache-path", str(run / "cache"),
                                 "--tensor-model-parallel-size", "2", *offload_args(run, tiers=("host",))],
                           train_iters=FINETUNE_ITERS, mock_data=False,
                           model_args=[*model_args, "--seq-length", "32", "--micro-batch-size", "2",
                                       "--global-batch-size", "4", "--lr", "1e-2", "--device", "cpu",
                                       "--log-interval", "1", "--num-workers", "0", "--seed", "1"])
    (run / "ckpt" / convert.MODEL_ARGS).write_text((ckpt / convert.MODEL_ARGS).read_text())  # for hf_forward.py
    return run / "ckpt", records


@pytest.fixture(scope="module")
def ours(work, imported, finetuned, tokens):
    """Our logits: 'family@layout' (and 'finetuned@1:1:1') -> [batch, seq, padded vocab], from one
    launch of 4 ranks (TP1 runs data-parallel over them)."""
    torch.save(tokens, work / "tokens.pt")
    specs = {}
    for name, (_, ckpt) in imported.items():
        for layout in layouts(name):
            specs[f"{name}@{layout}"] = f"{ckpt}:{layout}"
    specs["finetuned@1:1:1"] = f"{finetuned[0]}:1:1:1"
    cmd = launch_command([str(work / "ours.pt"), str(work / "tokens.pt"), *specs.values()], 4, warm=True,
                         script=HF_FORWARD)
    code, output = run_and_clean_up(cmd, pretrain_env(), 300, work / "forward.out")
    assert code == 0, output[-4000:]
    by_spec = torch.load(work / "ours.pt")
    return {label: by_spec[spec] for label, spec in specs.items()}


def assert_close_to(ref, ours, what):
    scale = ref.abs().max().item()
    diff = (ours[..., : ref.shape[-1]] - ref).abs().max().item()
    assert diff <= 1e-4 * scale, f"{what}: max |ours - transformers| = {diff:.3g}, logits' scale {scale:.3g}"


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_logits_match_transformers(family, imported, ours, tokens):
    """At TP1 and split (TP2 x PP2, or EP2 x PP2 for MoE); the padded rows are not compared."""
    ref = hf_logits(imported[family][0], tokens)
    for layout in layouts(family):
        assert_close_to(ref, ours[f"{family}@{layout}"], f"{family} at TP:PP:EP {layout}")


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_export_of_an_import_is_bit_identical(family, imported, work):
    from safetensors import safe_open

    hf_dir, ckpt = imported[family]
    out = work / f"export_{family}"
    convert.export_checkpoint(str(ckpt), str(out))

    def tensors(directory):
        found = {}
        for name in os.listdir(directory):
            if name.endswith(".safetensors"):
                with safe_open(str(directory / name), "pt") as f:
                    found.update({k: f.get_tensor(k) for k in f.keys()})
        return found

    original, exported = tensors(hf_dir), tensors(out)
    assert sorted(exported) == sorted(original)
    for name, tensor in original.items():
        assert exported[name].dtype == tensor.dtype and torch.equal(exported[name], tensor), name
    config = json.loads((out / "config.json").read_text())
    assert config == {**json.loads((hf_dir / "config.json").read_text()), **{"dtype": "float32"}}


def test_finetuned_export_loads_and_matches_ours(work, imported, finetuned, ours, tokens):
    """Trained from the import (loss finite, weights moved), exported with the config and tokenizer
    the import kept (found through the run's --load), loaded by transformers: its logits are ours."""
    import transformers

    run_ckpt, records = finetuned
    assert len(records) == FINETUNE_ITERS and all(math.isfinite(v) for v in losses(records))
    out = work / "export_finetuned"
    convert.export_checkpoint(str(run_ckpt), str(out))
    ref = hf_logits(out, tokens)
    assert_close_to(ref, ours["finetuned@1:1:1"], "the fine-tuned checkpoint")
    before = hf_logits(imported["llama3"][0], tokens)
    assert (ref - before).abs().max() > 1e-3, "the fine-tuning changed nothing"
    tokenizer = transformers.AutoTokenizer.from_pretrained(out)
    assert tokenizer("the") == transformers.AutoTokenizer.from_pretrained(imported["llama3"][0])("the")


def variant(work, imported, name, config_change=None, drop=None, add=None):
    """A copy of the llama3 model with its config.json changed, a tensor dropped or one added."""
    from megatron.training.hf.files import SafetensorsReader, SafetensorsWriter

    source = imported["llama3"][0]
    out = work / name
    out.mkdir()
    config = {**json.loads((source / "config.json").read_text()), **(config_change or {})}
    (out / "config.json").write_text(json.dumps(config))
    reader = SafetensorsReader(str(source))
    tensors = {n: reader.read(n) for n in reader.names() if n != drop}
    tensors.update(add or {})
    writer = SafetensorsWriter(str(out), {n: (t.dtype, t.shape) for n, t in tensors.items()}, 10**9)
    for n, t in tensors.items():
        writer.write(n, t)
    writer.close()
    return out


REFUSED = {
    "family": (dict(config_change={"model_type": "gpt2"}), "model_type 'gpt2'"),
    "activation": (dict(config_change={"hidden_act": "gelu"}), "hidden_act 'gelu'"),
    "rope": (dict(config_change={"rope_parameters": {"rope_type": "linear", "factor": 2.0}}), "rope_type 'linear'"),
    "llama3_constants": (dict(config_change={"rope_parameters": {**LLAMA3_ROPE, "low_freq_factor": 2.0}}),
                         "low_freq_factor 2.0"),
    "sliding_window": (dict(config_change={"sliding_window": 64}), "sliding_window 64"),
    "output_bias": (dict(config_change={"attention_bias": True}), "attention_bias"),
    "missing_tensor": (dict(drop="model.layers.1.mlp.up_proj.weight"), "model.layers.1.mlp.up_proj.weight"),
    "extra_tensor": (dict(add={"model.layers.1.mlp.extra.weight": torch.zeros(2)}), "model.layers.1.mlp.extra.weight"),
}


@pytest.mark.parametrize("case", sorted(REFUSED))
def test_what_does_not_map_is_refused_in_one_line_before_anything_is_written(case, work, imported, capsys):
    from launch import tool_module

    change, named = REFUSED[case]
    hf_dir = variant(work, imported, f"refused_{case}", **change)
    target = work / f"refused_{case}_ckpt"
    assert tool_module("hf_checkpoint").main(["import", str(hf_dir), str(target)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: ") and named in err[0], err
    assert not target.exists()


@pytest.mark.parametrize("flags, named", [
    (["--tensor-model-parallel-size", "3"], "--tensor-model-parallel-size"),
    (["--pipeline-model-parallel-size", "4"], "--pipeline-model-parallel-size"),
    (["--expert-model-parallel-size", "2"], "--expert-model-parallel-size"),  # llama3 has no experts
])
def test_a_layout_the_model_does_not_split_into_is_refused(flags, named, work, imported, capsys):
    from launch import tool_module

    target = work / f"layout_{flags[0]}"
    assert tool_module("hf_checkpoint").main(["import", str(imported["llama3"][0]), str(target), *flags]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and named in err[0], err
    assert not target.exists()


@pytest.mark.parametrize("family", ["llama3", "deepseek_v2"])
def test_the_planner_takes_the_model_from_a_hugging_face_config(family, imported, capsys):
    """--hf-config gives the planner the flags the import wrote; a flag given after it wins."""
    from launch import tool_module

    hf_dir, ckpt = imported[family]
    planner = tool_module("plan_offload")
    _, _, flags = planner.parse(["--hf-config", str(hf_dir / "config.json"), "--seq-length", "64",
                                 "--micro-batch-size", "1", "--bf16"])
    model_args = (ckpt / convert.MODEL_ARGS).read_text().split()
    assert flags[: len(model_args)] == model_args
    _, _, overridden = planner.parse(["--hf-config", str(hf_dir), "--seq-length", "64", "--micro-batch-size", "1",
                                      "--max-position-embeddings", "64"])
    one_gpu = argparse.Namespace(world=1, nnodes=1, gpus_per_node=1)
    assert planner.pretrain_args(overridden, one_gpu).max_position_embeddings == 64


def test_the_planner_help_lists_the_model_and_offload_flags(capsys):
    from launch import tool_module

    with pytest.raises(SystemExit):
        tool_module("plan_offload").main(["--help"])
    out = capsys.readouterr().out
    for flag in ("--hf-config", "--gpu-memory-gb", "--num-layers", "--hidden-size", "--num-experts",
                 "--tensor-model-parallel-size", "--offload-tiers", "--offload-host-cache-gb"):
        assert f"  {flag}" in out, flag


@pytest.mark.parametrize("family", ["llama3", "qwen3_moe"])
def test_without_a_config_the_export_derives_one_from_the_saved_args(family, work, imported, tokens):
    """A checkpoint with no config.json in reach (as a run trained from scratch): the export derives the
    family from its args (Llama 3's RoPE scaling, Qwen3-MoE's routing); transformers' logits on it are the
    original model's on the tokenizer's rows."""
    import shutil

    hf_dir, ckpt = imported[family]
    bare = work / f"bare_{family}"
    shutil.copytree(ckpt, bare, ignore=shutil.ignore_patterns("hf"))
    out = work / f"derived_{family}"
    convert.export_checkpoint(str(bare), str(out))
    config = json.loads((out / "config.json").read_text())
    assert config["model_type"] == json.loads((hf_dir / "config.json").read_text())["model_type"]
    derived, original = hf_logits(out, tokens), hf_logits(hf_dir, tokens)
    assert torch.equal(derived[..., : original.shape[-1]], original)
