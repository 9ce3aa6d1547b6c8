"""Megatron-LM's flags as its scripts pass them: taken with Megatron-LM's meaning where this fork runs it, else
refused in one line naming the flag (never an unrecognized argument, never ignored)."""

import pytest
import torch

from megatron.training.args.arguments import parse_args
from megatron.training.errors import UserError
from megatron.training.model import kernels
from megatron.training.model.configs import ddp_config_of

BASE = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "32",
        "--micro-batch-size", "1", "--train-iters", "10", "--lr", "1e-3", "--mock-data", "--device", "cpu"]
MOE = ["--num-experts", "4", "--moe-router-topk", "2"]


def refusal(argv) -> str:
    with pytest.raises(UserError) as refused:
        parse_args(argv)
    message = str(refused.value)
    assert message.count("\n") == 0
    return message


def test_adam_is_taken_and_is_the_default():
    assert parse_args(BASE + ["--optimizer", "adam"]).optimizer == "adam"
    assert parse_args(BASE).optimizer == "adam"


@pytest.mark.parametrize("other", ["sgd", "muon", "dist_muon", "lion", "soap", "adaptive_muon"])
def test_megatron_lms_other_optimizers_are_refused_in_one_line(other):
    message = refusal(BASE + ["--optimizer", other])
    assert "--optimizer" in message and repr(other) in message and "adam" in message


@pytest.mark.parametrize("precision", [[], ["--bf16"]])
def test_gradients_accumulated_in_fp32_as_asked(precision):
    plain = ddp_config_of(parse_args(BASE + precision))
    asked = ddp_config_of(parse_args(BASE + precision + ["--accumulate-allreduce-grads-in-fp32"]))
    assert asked.grad_reduce_in_fp32 == plain.grad_reduce_in_fp32 == bool(precision)  # fp32 training: fp32 grads


@pytest.mark.parametrize("other", [["--fp16"], ["--bf16", "--grad-reduce-in-bf16"]])
def test_fp32_accumulation_refused_beside_what_contradicts_it(other):
    message = refusal(BASE + other + ["--accumulate-allreduce-grads-in-fp32"])
    assert "--accumulate-allreduce-grads-in-fp32" in message and other[-1] in message


def test_the_nan_check_is_on_by_default_and_off_when_asked():
    assert parse_args(BASE + ["--bf16"]).check_for_nan_in_loss_and_grad
    assert ddp_config_of(parse_args(BASE + ["--bf16"])).check_for_nan_in_grad
    off = parse_args(BASE + ["--bf16", "--no-check-for-nan-in-loss-and-grad"])
    assert not off.check_for_nan_in_loss_and_grad and not ddp_config_of(off).check_for_nan_in_grad
    assert not ddp_config_of(parse_args(BASE + ["--fp16"])).check_for_nan_in_grad  # the loss scaler's job


def test_moe_permute_fusion_needs_experts_and_transformer_engine(monkeypatch):
    assert "--moe-permute-fusion: requires --num-experts" in refusal(BASE + ["--moe-permute-fusion"])
    monkeypatch.setattr(kernels, "installed", lambda module: module != "transformer_engine")
    message = refusal(BASE + MOE + ["--moe-permute-fusion"])
    assert "--moe-permute-fusion" in message and "transformer-engine" in message
    monkeypatch.setattr(kernels, "installed", lambda module: True)
    assert parse_args(BASE + MOE + ["--moe-permute-fusion"]).moe_permute_fusion
    assert not parse_args(BASE + MOE).moe_permute_fusion


def test_the_fp16_loss_scalers_knobs_reach_its_scaler(monkeypatch):
    from megatron.training.model.configs import optimizer_config
    from megatron.training.offload import shard
    made = []
    monkeypatch.setattr(shard, "DynamicGradScaler", lambda **kwargs: made.append(kwargs))  # its tensors need CUDA
    shard.grad_scaler_for(optimizer_config(parse_args(BASE + ["--fp16"])))
    shard.grad_scaler_for(optimizer_config(parse_args(
        BASE + ["--fp16", "--min-loss-scale", "4", "--loss-scale-window", "50", "--hysteresis", "3"])))
    knobs = [(m["min_scale"], m["growth_interval"], m["hysteresis"]) for m in made]
    assert knobs == [(1.0, 1000, 2), (4.0, 50, 3)]  # Megatron-LM's defaults, then as asked
    assert "--min-loss-scale: must be > 0" in refusal(BASE + ["--fp16", "--min-loss-scale", "0"])


def test_the_data_flags_megatron_lm_scripts_pass():
    assert parse_args(BASE + ["--dataloader-type", "single"]).dataloader_type == "single"
    for other in ("cyclic", "external"):
        message = refusal(BASE + ["--dataloader-type", other])
        assert "--dataloader-type" in message and repr(other) in message
    assert parse_args(BASE + ["--num-dataset-builder-threads", "4"]).num_dataset_builder_threads == 4
    assert "--reset-attention-mask: not built" in refusal(BASE + ["--reset-attention-mask"])
    assert "--reset-position-ids" in refusal(BASE + ["--reset-position-ids"])  # mock data: no documents


def test_position_ids_restart_after_each_end_of_document(tmp_path):
    from megatron.training.data.datasets import build_gpt_datasets, build_tokenizer

    data, flags = corpus_flags(tmp_path)
    flags += ["--data-path", f"{data}/corpus_text_document", "--split", "100,0,0"]
    samples = {}
    for reset in (False, True):
        args = parse_args(flags + (["--reset-position-ids"] if reset else []))
        tokenizer = build_tokenizer(args)
        train, _ = build_gpt_datasets(args, tokenizer, 8, 0)
        samples[reset] = [train[i] for i in range(8)]
        eod = tokenizer.eod
    restarted = 0
    for plain, reset in zip(samples[False], samples[True]):
        assert torch.equal(plain["tokens"], reset["tokens"])
        assert torch.equal(plain["position_ids"], torch.arange(128))
        expected, position = [], 0
        for token in reset["tokens"].tolist():
            expected.append(position)
            position = 0 if token == eod else position + 1
        assert reset["position_ids"].tolist() == expected
        restarted += expected != list(range(128))
    assert restarted > 0  # the corpus's documents end inside these samples


def test_xavier_uniform_initialisation_reaches_the_model():
    from megatron.training.model.configs import transformer_config
    plain = transformer_config(parse_args(BASE))
    xavier = transformer_config(parse_args(BASE + ["--init-method-xavier-uniform"]))
    assert xavier.init_method is torch.nn.init.xavier_uniform_
    assert xavier.output_layer_init_method is torch.nn.init.xavier_uniform_
    assert xavier.embedding_init_method is torch.nn.init.xavier_uniform_  # megatron-core follows init_method
    bound = (6 / (256 + 64)) ** 0.5  # Xavier-uniform's for a 256 x 64 weight
    weight = torch.empty(256, 64)
    plain.init_method(weight)
    assert weight.std().item() == pytest.approx(0.02, rel=0.1)  # --init-method-std's normal
    xavier.init_method(weight)
    assert weight.abs().max() <= bound and weight.std().item() == pytest.approx(bound / 3 ** 0.5, rel=0.1)


@pytest.mark.parametrize("flag", [["--use-dist-ckpt"], ["--dist-ckpt-format", "torch_dist"]])
def test_megatron_lms_deprecated_checkpoint_spellings_are_taken_and_said_to_do_nothing(flag, capsys, monkeypatch):
    monkeypatch.setenv("RANK", "0")
    assert parse_args(BASE + flag).ckpt_format == "torch_dist"
    assert f"> {flag[0]} is deprecated (as in Megatron-LM) and has no effect" in capsys.readouterr().out
    monkeypatch.setenv("RANK", "1")
    parse_args(BASE + flag)
    assert capsys.readouterr().out == ""  # said once, by the first rank


def corpus_flags(tmp_path):
    import os
    data = os.path.join(os.path.dirname(__file__), "..", "data", "upstream_gpt")
    return data, ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "128",
                  "--micro-batch-size", "1", "--train-iters", "4", "--lr", "1e-3", "--device", "cpu",
                  "--tokenizer-type", "GPT2BPETokenizer", "--vocab-file", f"{data}/vocab.json",
                  "--merge-file", f"{data}/merges.txt", "--data-cache-path", str(tmp_path)]


def test_each_splits_data_by_its_own_flag(tmp_path):
    from megatron.training.data.datasets import build_gpt_datasets, build_tokenizer

    data, flags = corpus_flags(tmp_path)
    corpus = f"{data}/corpus_text_document"
    whole = parse_args(flags + ["--data-path", corpus, "--split", "100,0,0"])
    per_split = parse_args(flags + ["--train-data-path", corpus, "--valid-data-path", corpus,
                                    "--test-data-path", corpus])
    tokenizer = build_tokenizer(whole)
    train_whole, _ = build_gpt_datasets(whole, tokenizer, 8, 0)
    train, valid = build_gpt_datasets(per_split, tokenizer, 8, 4)
    for i in range(8):  # the whole corpus as the training split both ways: the same samples
        assert torch.equal(train[i]["tokens"], train_whole[i]["tokens"])
    assert valid is not None and len(valid) >= 4
    assert build_gpt_datasets(per_split, tokenizer, 8, 0)[1] is None  # no validation asked: none built

    assert "--valid-data-path: requires --train-data-path" in refusal(flags + ["--data-path", corpus,
                                                                               "--valid-data-path", corpus])
    assert "--train-data-path: not allowed with --data-path" in refusal(flags + ["--data-path", corpus,
                                                                                 "--train-data-path", corpus])
    assert "give exactly one of --mock-data, --data-path or --train-data-path" in refusal(
        flags + ["--mock-data", "--train-data-path", corpus])
    missing = parse_args(flags + ["--train-data-path", corpus, "--valid-data-path", f"{data}/nonexistent"])
    with pytest.raises(UserError) as refused:
        build_gpt_datasets(missing, tokenizer, 8, 4)
    assert str(refused.value).startswith("--valid-data-path: ") and "nonexistent.bin does not exist" in str(refused.value)
