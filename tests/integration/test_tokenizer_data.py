"""Megatron-LM's tokenizer flags end to end: tokenizer files made here from the shipped corpus
(GPT-2 vocab.json + merges.txt, a HuggingFace tokenizer directory, a SentencePiece model),
tools/preprocess_data.py with each, the ids checked against the tokenizer library itself, then
two iterations of pretrain_gpt.py on the result. Also: data beyond the vocabulary, bad flags."""

import json
import math
import subprocess
import sys

import numpy as np
import pytest

from launch import REPO, TINY_MODEL, losses, run_pretrain

CORPUS = REPO / "examples" / "data" / "corpus.jsonl"
NUM_DOCS = 40  # a slice: tokenizer training and preprocessing stay within seconds
GPT2_EOD = "<|endoftext|>"


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
    done = subprocess.run([sys.executable, str(REPO / "tools" / "preprocess_data.py"), "--input", str(corpus),
                           "--output-prefix", str(prefix), *tokenizer_flags, *extra],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
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


def check_ids_and_train(tmp_path, corpus_slice, texts, flags, encode, eod, extra=()):
    data = preprocess(corpus_slice, tmp_path / "corpus", flags, "--append-eod", *extra)
    assert stored_documents(data) == [encode(t) + [eod] for t in texts]
    train_two_iterations(tmp_path / "run", data, flags)


def test_gpt2_bpe_files(tmp_path, corpus_slice, texts, byte_bpe):
    bpe, gpt2_dir, _ = byte_bpe
    flags = ["--tokenizer-type", "GPT2BPETokenizer", "--vocab-file", str(gpt2_dir / "vocab.json"),
             "--merge-file", str(gpt2_dir / "merges.txt")]
    # Two workers, two partitions: the merged files must hold the documents in input order.
    check_ids_and_train(tmp_path, corpus_slice, texts, flags, lambda t: bpe.encode(t).ids,
                        bpe.token_to_id(GPT2_EOD),
                        extra=("--workers", "2", "--partitions", "2", "--keep-sequential-samples"))


def test_huggingface_directory(tmp_path, corpus_slice, texts, byte_bpe):
    bpe, _, hf_dir = byte_bpe
    check_ids_and_train(tmp_path, corpus_slice, texts,
                        ["--tokenizer-type", "HuggingFaceTokenizer", "--tokenizer-model", str(hf_dir)],
                        lambda t: bpe.encode(t).ids, bpe.token_to_id(GPT2_EOD))


def test_sentencepiece_model(tmp_path, corpus_slice, texts, sentencepiece_model):
    sp, model_file = sentencepiece_model
    check_ids_and_train(tmp_path, corpus_slice, texts,
                        ["--tokenizer-type", "GPTSentencePieceTokenizer", "--tokenizer-model", model_file],
                        lambda t: sp.encode(t), sp.eos_id())


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
    # torchrun prints its own ChildFailedError traceback; no rank may print one.
    assert "IndexError" not in out["output"] and 'pretrain_gpt.py", line' not in out["output"]


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
    from megatron.training.arguments import parse_args
    from megatron.training.errors import UserError
    from megatron.training.tokenizers import build_tokenizer

    args = parse_args([*TINY_MODEL, "--mock-data", "--train-iters", "1", *flags])
    with pytest.raises(UserError) as err:
        build_tokenizer(args)
    assert str(err.value).startswith(expected), str(err.value)
    assert "\n" not in str(err.value)


def test_append_eod_is_opt_in(tmp_path, corpus_slice, texts):
    """Megatron-LM appends EOD only when asked (--append-eod). In-process: no interpreter start-up."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("preprocess_data", REPO / "tools" / "preprocess_data.py")
    tool = sys.modules["preprocess_data"] = importlib.util.module_from_spec(spec)  # the pool pickles by name
    spec.loader.exec_module(tool)
    for name, extra, eod in (("plain", [], []), ("ended", ["--append-eod"], [256])):
        assert tool.main(["--input", str(corpus_slice), "--output-prefix", str(tmp_path / name), *extra]) == 0
        assert stored_documents(f"{tmp_path / name}_text_document") == [list(t.encode()) + eod for t in texts]


def tokenizer_args(*flags):
    from megatron.training.arguments import parse_args

    return parse_args([*TINY_MODEL, "--mock-data", "--train-iters", "1", *flags])


def test_tiktoken_file_matches_tiktoken(tmp_path):
    """megatron-core's TikTokenizer on a tiny rank file: tiktoken's own ids, shifted past the
    special tokens; --vocab-size is the tokenizer's size (special tokens + ranks), as in Megatron-LM."""
    import base64

    import tiktoken
    from megatron.core.tokenizers.text.libraries.tiktoken_tokenizer import _PATTERN_TIKTOKEN_V2
    from megatron.training.tokenizers import build_tokenizer, padded_vocab_size

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
    from megatron.training.tokenizers import build_tokenizer, padded_vocab_size

    args = tokenizer_args("--tokenizer-type", "NullTokenizer", "--vocab-size", "1100")
    args.tensor_model_parallel_size = tp
    tokenizer = build_tokenizer(args)
    assert tokenizer.vocab_size == 1101  # the ids, then EOD
    assert padded_vocab_size(args, tokenizer) == expected
