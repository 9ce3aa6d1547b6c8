"""Megatron-LM's tokenizer flags end to end: tokenizer files made here from the shipped corpus
(GPT-2 vocab.json + merges.txt, a HuggingFace tokenizer directory, a SentencePiece model),
tools/preprocess_data.py with each (megatron-core's tokenizer classes), the ids checked against the
tokenizer library itself reading the same files, then two iterations of pretrain_gpt.py on the
result. Also: data beyond the vocabulary, bad flags and missing files (one line, no network)."""

import importlib.util
import json
import math
import os
import socket
import sys

import numpy as np
import pytest

from launch import REPO, TINY_MODEL, losses, ranks_output, run_pretrain

CORPUS = REPO / "examples" / "data" / "corpus.jsonl"
NUM_DOCS = 40  # a slice: tokenizer training and preprocessing stay within seconds
GPT2_EOD = "<|endoftext|>"
HUB_NAME = "mlp-offload-tests/no-such-tokenizer"  # a Hub-style name no local cache holds


@pytest.fixture(scope="module")
def workdir(tmp_path_factory):
    return tmp_path_factory.mktemp("tokenizer_data")


@pytest.fixture(scope="module")
def texts():
    return [json.loads(line)["text"] for line in CORPUS.read_text().splitlines()[:NUM_DOCS]]


@pytest.fixture(scope="module")
def corpus_slice(workdir, texts):
    path = workdir / "slice.jsonl"
    path.write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
    return path


@pytest.fixture(scope="module")
def byte_bpe(workdir, texts):
    """A byte-level BPE trained here, saved as GPT-2 files and as a HuggingFace directory."""
    from tokenizers import ByteLevelBPETokenizer

    bpe = ByteLevelBPETokenizer(add_prefix_space=False)
    bpe.train_from_iterator(texts, vocab_size=600, min_frequency=2, special_tokens=[GPT2_EOD],
                            show_progress=False)
    gpt2_dir = workdir / "gpt2"
    gpt2_dir.mkdir()
    bpe.save_model(str(gpt2_dir))
    hf_dir = workdir / "hf"
    hf_dir.mkdir()
    bpe.save(str(hf_dir / "tokenizer.json"))
    (hf_dir / "tokenizer_config.json").write_text(json.dumps(
        {"eos_token": GPT2_EOD, "tokenizer_class": "GPT2TokenizerFast"}))
    return bpe, gpt2_dir, hf_dir


@pytest.fixture(scope="module")
def sentencepiece_model(workdir, texts):
    import sentencepiece as spm

    prefix = workdir / "sp"
    spm.SentencePieceTrainer.train(sentence_iterator=iter(texts), model_prefix=str(prefix), vocab_size=300,
                                   model_type="bpe", character_coverage=1.0, minloglevel=2,
                                   num_threads=1)
    return spm.SentencePieceProcessor(model_file=f"{prefix}.model"), f"{prefix}.model"


def preprocess(corpus, prefix, tokenizer_flags, *extra):
    """tools/preprocess_data.py's main in this process, which has imported megatron-core already (a
    command line would spend 5 of its 9 s importing it; test_real_data runs the command line)."""
    code = load_preprocess_tool().main(["--input", str(corpus), "--output-prefix", str(prefix), *tokenizer_flags,
                                        *extra])
    assert code == 0
    return f"{prefix}_text_document"


def stored_documents(data_prefix):
    from megatron.core.datasets.indexed_dataset import IndexedDataset

    ds = IndexedDataset(data_prefix)
    return [ds[i].tolist() for i in range(len(ds))]


def train_two_iterations(run_dir, data_prefix, tokenizer_flags):
    records = run_pretrain(run_dir, ["--data-path", data_prefix, "--data-cache-path", str(run_dir / "cache"),
                                     "--split", "1,0,0", "--eval-iters", "0", *tokenizer_flags],
                           train_iters=2, mock_data=False)
    assert len(records) == 2 and all(math.isfinite(v) for v in losses(records))
    return records


def load_preprocess_tool():
    """tools/preprocess_data.py as a module, in this process."""
    spec = importlib.util.spec_from_file_location("preprocess_data", REPO / "tools" / "preprocess_data.py")
    tool = sys.modules["preprocess_data"] = importlib.util.module_from_spec(spec)  # the pool pickles by name
    spec.loader.exec_module(tool)
    return tool


def preprocess_tokenizer(corpus, flags):
    """The tokenizer each preprocess_data.py worker builds for these flags."""
    tool = load_preprocess_tool()
    _, args = tool.parse_args(["--input", str(corpus), "--output-prefix", "unused", *flags])
    tool.Encoder(args).initializer()
    return tool.Encoder.tokenizer


def assert_megatron_core_tokenizer(tokenizer, library_class: str):
    """megatron-core's text tokenizer, around megatron-core's class for that tokenizer library."""
    from megatron.core.tokenizers.text.text_tokenizer import MegatronTokenizerText

    assert isinstance(tokenizer, MegatronTokenizerText), type(tokenizer)
    assert type(tokenizer).__module__.startswith("megatron.core.tokenizers."), type(tokenizer)
    library = type(tokenizer._tokenizer)
    assert library.__module__.startswith("megatron.core.tokenizers.text.libraries."), library
    assert library.__name__ == library_class, library


def check_ids_and_train(tmp_path, corpus_slice, texts, flags, encode, eod, extra=()):
    data = preprocess(corpus_slice, tmp_path / "corpus", flags, "--append-eod", *extra)
    assert stored_documents(data) == [encode(t) + [eod] for t in texts]
    train_two_iterations(tmp_path / "run", data, flags)


def test_gpt2_bpe_files(tmp_path, corpus_slice, texts, byte_bpe):
    from tokenizers import ByteLevelBPETokenizer

    _, gpt2_dir, _ = byte_bpe
    vocab, merges = str(gpt2_dir / "vocab.json"), str(gpt2_dir / "merges.txt")
    flags = ["--tokenizer-type", "GPT2BPETokenizer", "--vocab-file", vocab, "--merge-file", merges]
    tokenizer = preprocess_tokenizer(corpus_slice, flags)
    assert_megatron_core_tokenizer(tokenizer, "HuggingFaceTokenizer")
    # The dataset cache key is Megatron-LM's for these flags, not a temporary directory's.
    assert tokenizer.unique_identifiers["tokenizer_path"] == "GPT2BPETokenizer"
    assert tokenizer.unique_identifiers["merges_file"] == merges
    reference = ByteLevelBPETokenizer.from_file(vocab, merges, add_prefix_space=False)
    assert tokenizer.vocab_size == reference.get_vocab_size()
    # Two workers, two partitions: the merged files must hold the documents in input order.
    check_ids_and_train(tmp_path, corpus_slice, texts, flags, lambda t: reference.encode(t).ids,
                        reference.token_to_id(GPT2_EOD),
                        extra=("--workers", "2", "--partitions", "2", "--keep-sequential-samples"))


def test_huggingface_directory(tmp_path, corpus_slice, texts, byte_bpe):
    from tokenizers import Tokenizer

    _, _, hf_dir = byte_bpe
    flags = ["--tokenizer-type", "HuggingFaceTokenizer", "--tokenizer-model", str(hf_dir)]
    tokenizer = preprocess_tokenizer(corpus_slice, flags)
    assert_megatron_core_tokenizer(tokenizer, "HuggingFaceTokenizer")
    reference = Tokenizer.from_file(str(hf_dir / "tokenizer.json"))
    assert tokenizer.vocab_size == reference.get_vocab_size()
    check_ids_and_train(tmp_path, corpus_slice, texts, flags, lambda t: reference.encode(t).ids,
                        reference.token_to_id(GPT2_EOD))


def test_sentencepiece_model(tmp_path, corpus_slice, texts, sentencepiece_model):
    sp, model_file = sentencepiece_model
    flags = ["--tokenizer-type", "GPTSentencePieceTokenizer", "--tokenizer-model", model_file]
    assert_megatron_core_tokenizer(preprocess_tokenizer(corpus_slice, flags), "SentencePieceTokenizer")
    check_ids_and_train(tmp_path, corpus_slice, texts, flags, lambda t: sp.encode(t), sp.eos_id())


def test_token_ids_beyond_the_vocabulary_are_one_line(tmp_path):
    """GPT-2-sized ids read with the byte-level tokenizer: a line naming the file, before training."""
    from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder

    prefix = str(tmp_path / "gpt2ids_text_document")
    builder = IndexedDatasetBuilder(prefix + ".bin", dtype=np.uint16)
    rng = np.random.default_rng(0)
    for _ in range(20):
        builder.add_document(rng.integers(0, 200, 100).tolist() + [50256], [101])
    builder.finalize(prefix + ".idx")
    out = run_pretrain(tmp_path / "run", ["--data-path", prefix, "--split", "1,0,0", "--eval-iters", "0",
                                          "--tokenizer-type", "ByteLevelTokenizer"],
                       train_iters=2, mock_data=False, expect_success=False)[0]
    assert out["returncode"] != 0, out["output"][-3000:]
    expected = (f"--data-path: {prefix} holds token id 50256, beyond the ByteLevelTokenizer vocabulary "
                "of 258 tokens")
    lines = [line for line in out["output"].splitlines() if expected in line]
    assert len(lines) == 1, out["output"][-3000:]
    ranks = ranks_output(out["output"])  # under torchrun, without its own report of the failure
    assert "IndexError" not in ranks and "Traceback" not in ranks, out["output"][-3000:]


@pytest.mark.parametrize("flags, expected", [
    (["--tokenizer-type", "HuggingFaceTokenizer", "--tokenizer-model", "gpt2"],
     "--tokenizer-model: gpt2 is not a local directory and nothing is downloaded here"),
    (["--tokenizer-type", "GPT2BPETokenizer", "--vocab-file", "/nonexistent/vocab.json",
      "--merge-file", "/nonexistent/merges.txt"], "--vocab-file: /nonexistent/vocab.json is not a file"),
    (["--tokenizer-type", "GPT2BPETokenizer"], "--vocab-file: required with --tokenizer-type GPT2BPETokenizer"),
    (["--tokenizer-type", "Llama2Tokenizer", "--tokenizer-model", "/nonexistent/tok.model"],
     "--tokenizer-model: /nonexistent/tok.model is not a file"),
    (["--tokenizer-type", "NullTokenizer"], "--vocab-size: required with --tokenizer-type NullTokenizer"),
])
def test_tokenizer_flag_errors_name_the_flag(flags, expected):
    from megatron.training.args.arguments import parse_args
    from megatron.training.errors import UserError
    from megatron.training.data.tokenizers import build_tokenizer

    args = parse_args([*TINY_MODEL, "--mock-data", "--train-iters", "1", *flags])
    with pytest.raises(UserError) as err:
        build_tokenizer(args)
    assert str(err.value).startswith(expected), str(err.value)
    assert "\n" not in str(err.value)


@pytest.fixture
def no_network(monkeypatch):
    """Every name lookup or connection attempt, recorded and refused."""
    attempts = []

    def refuse(*args, **kwargs):
        attempts.append(args)
        raise OSError("network use in a test that must not reach the network")

    monkeypatch.setattr(socket, "getaddrinfo", refuse)
    monkeypatch.setattr(socket.socket, "connect", refuse)
    return attempts


def test_missing_tokenizer_files_are_one_line_without_network(tmp_path, byte_bpe, no_network):
    from megatron.training.errors import UserError
    from megatron.training.data.tokenizers import build_tokenizer

    _, gpt2_dir, hf_dir = byte_bpe
    vocab, merges = str(gpt2_dir / "vocab.json"), str(gpt2_dir / "merges.txt")
    no_eod = tmp_path / "no_eod.json"
    no_eod.write_text(json.dumps({t: i for t, i in json.loads((gpt2_dir / "vocab.json").read_text()).items()
                                  if t != GPT2_EOD}))
    config_only = tmp_path / "config_only"
    config_only.mkdir()
    (config_only / "tokenizer_config.json").write_text((hf_dir / "tokenizer_config.json").read_text())
    no_eos = tmp_path / "no_eos"
    no_eos.mkdir()
    (no_eos / "tokenizer.json").write_text((hf_dir / "tokenizer.json").read_text())
    gpt2, hf = ["--tokenizer-type", "GPT2BPETokenizer"], ["--tokenizer-type", "HuggingFaceTokenizer"]
    cases = [
        (gpt2 + ["--vocab-file", vocab, "--merge-file", str(tmp_path / "merges.txt")],
         f"--merge-file: {tmp_path / 'merges.txt'} is not a file"),
        (gpt2 + ["--vocab-file", str(no_eod), "--merge-file", merges],
         f"--vocab-file: {no_eod} has no {GPT2_EOD} token"),
        (gpt2 + ["--vocab-file", merges, "--merge-file", merges],
         f"--vocab-file: {merges} could not be read as a GPT-2 vocab.json"),
        (gpt2 + ["--vocab-file", vocab, "--merge-file", vocab],
         f"--vocab-file/--merge-file: {vocab} and {vocab} could not be read as a GPT2BPETokenizer"),
        (hf + ["--tokenizer-model", "openai-community/gpt2"],
         "--tokenizer-model: openai-community/gpt2 is not a local directory and nothing is downloaded"),
        (hf + ["--tokenizer-model", str(hf_dir / "tokenizer.json")],
         f"--tokenizer-model: {hf_dir / 'tokenizer.json'} is a file"),
        (hf + ["--tokenizer-model", str(config_only)], f"--tokenizer-model: {config_only} holds no tokenizer files"),
        (hf + ["--tokenizer-model", str(no_eos)], f"--tokenizer-model: {no_eos} names no end-of-document token"),
    ]
    for flags, expected in cases:
        with pytest.raises(UserError) as err:
            build_tokenizer(tokenizer_args(*flags))
        assert str(err.value).startswith(expected) and "\n" not in str(err.value), (flags, str(err.value))
    assert no_network == []


def test_hub_names_fail_offline_past_our_checks(no_network):
    """Offline mode holds even where our checks would not stop a Hub name: megatron-core's
    HuggingFace tokenizer given one reads the local Hub cache only, and no socket is opened."""
    import huggingface_hub

    from megatron.training.data import tokenizers

    args = tokenizer_args("--tokenizer-type", "HuggingFaceTokenizer", "--tokenizer-model", HUB_NAME)
    tokenizers.hub_offline()
    with pytest.raises(Exception, match=f"Unable to instantiate HuggingFace AutoTokenizer for {HUB_NAME}"):
        tokenizers.megatron_core_tokenizer(args)
    assert os.environ["HF_HUB_OFFLINE"] == "1" and huggingface_hub.constants.is_offline_mode()
    assert no_network == []


def test_append_eod_is_opt_in(tmp_path, corpus_slice, texts):
    """Megatron-LM appends EOD only when asked (--append-eod). In-process: no interpreter start-up."""
    tool = load_preprocess_tool()
    for name, extra, eod in (("plain", [], []), ("ended", ["--append-eod"], [256])):
        assert tool.main(["--input", str(corpus_slice), "--output-prefix", str(tmp_path / name), *extra]) == 0
        assert stored_documents(f"{tmp_path / name}_text_document") == [list(t.encode()) + eod for t in texts]


def tokenizer_args(*flags):
    from megatron.training.args.arguments import parse_args

    return parse_args([*TINY_MODEL, "--mock-data", "--train-iters", "1", *flags])


def test_tiktoken_file_matches_tiktoken(tmp_path):
    """megatron-core's TikTokenizer on a tiny rank file: tiktoken's own ids, shifted past the
    special tokens; --vocab-size is the tokenizer's size (special tokens + ranks), as in Megatron-LM."""
    import base64

    import tiktoken
    from megatron.core.tokenizers.text.libraries.tiktoken_tokenizer import _PATTERN_TIKTOKEN_V2
    from megatron.training.data.tokenizers import build_tokenizer, padded_vocab_size

    ranks = [bytes([i]) for i in range(256)] + [b"th", b"the", b" the", b"er", b"in"]
    path = tmp_path / "ranks.json"
    path.write_text(json.dumps([{"rank": i, "token_bytes": base64.b64encode(t).decode(),
                                 "token_str": t.decode("latin-1")} for i, t in enumerate(ranks)]))
    num_special = 1000
    args = tokenizer_args("--tokenizer-type", "TikTokenizer", "--tokenizer-model", str(path),
                          "--tiktoken-pattern", "v2", "--vocab-size", str(num_special + len(ranks)))
    tokenizer = build_tokenizer(args)
    reference = tiktoken.Encoding(name="tiny", pat_str=_PATTERN_TIKTOKEN_V2,
                                  mergeable_ranks={t: i for i, t in enumerate(ranks)}, special_tokens={})
    text = "in the winter there were other things"
    assert tokenizer.tokenize(text) == [i + num_special for i in reference.encode(text)]
    assert padded_vocab_size(args, tokenizer) == 1280  # 1261 rounded up to 128


@pytest.mark.parametrize("tp, expected", [(1, 1152), (2, 1280), (4, 1536)])
def test_null_tokenizer_vocab_is_padded_as_megatron_lm(tp, expected):
    from megatron.training.data.tokenizers import build_tokenizer, padded_vocab_size

    args = tokenizer_args("--tokenizer-type", "NullTokenizer", "--vocab-size", "1100")
    args.tensor_model_parallel_size = tp
    tokenizer = build_tokenizer(args)
    assert tokenizer.vocab_size == 1101  # the ids, then EOD
    assert padded_vocab_size(args, tokenizer) == expected
