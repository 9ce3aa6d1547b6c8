"""Megatron-LM's tokenizer flags: define them, build the tokenizer they name, pad its vocabulary.

Every --tokenizer-type but our ByteLevelTokenizer (the default: the quickstart and the mock data use
it) is megatron-core's own (``megatron.core.tokenizers``). SentencePiece, TikToken, Null and
HuggingFaceTokenizer (a local directory, read by transformers' AutoTokenizer) are built by
megatron-core's builder, as Megatron-LM builds them. GPT2BPETokenizer is megatron-core's
HuggingFace tokenizer too, but not through that builder's GPT-2 entry (MegatronHFTokenizer): that
one loads the Hub's "gpt2" files by name (network, or a pre-filled Hub cache) and never reads
--merge-file (megatron-core 0.16.1 hands the vocabulary file over as the merges file, and transformers
ignores the misspelt ``merge_files`` it then passes). So --vocab-file and --merge-file are given to
megatron-core's HuggingFaceTokenizer as a GPT-2 tokenizer directory: links to the two files and a
tokenizer_config.json naming GPT2Tokenizer, in a temporary directory gone once they are read.

Nothing is ever downloaded: the Hub is put in offline mode (HF_HUB_OFFLINE, TRANSFORMERS_OFFLINE)
before transformers is imported, and a missing file or directory is one line naming its flag.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from types import SimpleNamespace

from megatron.training.errors import UserError

BYTE_LEVEL = "ByteLevelTokenizer"
SENTENCEPIECE_TYPES = ("SentencePieceTokenizer", "GPTSentencePieceTokenizer", "Llama2Tokenizer")
TOKENIZER_TYPES = (BYTE_LEVEL, "GPT2BPETokenizer", "HuggingFaceTokenizer", *SENTENCEPIECE_TYPES,
                   "TikTokenizer", "NullTokenizer")
# For these --vocab-size is the tokenizer's own size, as in Megatron-LM; for the others it is a
# floor on the vocabulary before padding (room for tokens the tokenizer does not have yet).
SIZED_BY_VOCAB_SIZE_FLAG = ("TikTokenizer", "NullTokenizer")
GPT2_EOD_TOKEN = "<|endoftext|>"
# A directory holding none of these has no vocabulary for AutoTokenizer to read.
HF_VOCABULARY_FILES = ("tokenizer.json", "vocab.json", "vocab.txt", "tekken.json")
HF_VOCABULARY_SUFFIXES = (".model", ".tiktoken")
MCORE_HF_WRAPPER = "Unable to instantiate HuggingFace AutoTokenizer"  # megatron-core's ValueError


def add_tokenizer_arguments(group) -> None:
    """Megatron-LM's tokenizer flags (names and defaults of its 0.16 release)."""
    group.add_argument("--tokenizer-type", choices=TOKENIZER_TYPES, default=BYTE_LEVEL,
                       help=f"default {BYTE_LEVEL} (ours: UTF-8 bytes + EOD, no files needed)")
    group.add_argument("--vocab-size", type=_positive_int, default=None,
                       help="NullTokenizer: its size before EOD; TikTokenizer: keep the first N ranks; "
                            "others: vocabulary size before padding, at least the tokenizer's")
    group.add_argument("--vocab-file", default=None, help="GPT2BPETokenizer: vocab.json")
    group.add_argument("--merge-file", default=None, help="GPT2BPETokenizer: merges.txt")
    group.add_argument("--tokenizer-model", default=None,
                       help="SentencePiece: the .model file; TikTokenizer: its .json; "
                            "HuggingFaceTokenizer: a local directory written by save_pretrained")
    group.add_argument("--tokenizer-metadata", default=None,
                       help="megatron-core tokenizer metadata (JSON file) for SentencePiece/TikToken/HuggingFace")
    group.add_argument("--tokenizer-special-tokens", nargs="+", default=None,
                       help="TikTokenizer: must include <unk> <s> </s> <mask> <pad> <cls> <sep>; "
                            "SentencePiece: needs --tokenizer-sentencepiece-legacy; "
                            "GPT2BPE/HuggingFace: added to the vocabulary where missing")
    group.add_argument("--tiktoken-pattern", choices=["v1", "v2"], default=None,
                       help="TikTokenizer: the regex that splits text before BPE. Default: megatron-core's, v2")
    group.add_argument("--tiktoken-num-special-tokens", type=_positive_int, default=1000,
                       help="TikTokenizer: ids reserved for special tokens before the BPE ranks. Default: %(default)s")
    group.add_argument("--tokenizer-sentencepiece-legacy", action="store_true",
                       help="SentencePiece: megatron-core's legacy wrapper, which takes --tokenizer-special-tokens")
    group.add_argument("--tokenizer-hf-use-fast", action="store_true",
                       help="GPT2BPE/HuggingFace: AutoTokenizer's use_fast (transformers 5 has fast ones only)")
    group.add_argument("--tokenizer-hf-include-special-tokens", action="store_true",
                       help="GPT2BPE/HuggingFace: add the tokenizer's special tokens (e.g. BOS) when encoding")
    group.add_argument("--trust-remote-code", action="store_true",
                       help="HuggingFaceTokenizer: let AutoTokenizer run the tokenizer code in the directory")


def build_tokenizer(args):
    """The tokenizer --tokenizer-type names; a missing or unreadable file is a UserError."""
    kind = args.tokenizer_type or BYTE_LEVEL
    if kind == BYTE_LEVEL:
        from megatron.training.data.byte_level_tokenizer import ByteLevelTokenizer

        return ByteLevelTokenizer()
    # megatron-core's tokenizer libraries import transformers whichever one is used.
    hub_offline()
    if kind == "GPT2BPETokenizer":
        vocab = _existing_file("--vocab-file", args.vocab_file, kind)
        merges = _existing_file("--merge-file", args.merge_file, kind)
        _needs_transformers(kind)
        _has_gpt2_eod(vocab)
        return _readable(kind, "--vocab-file/--merge-file", f"{vocab} and {merges}",
                         lambda: _gpt2_bpe_tokenizer(args, vocab, merges))
    if args.tokenizer_metadata is not None:
        _existing_file("--tokenizer-metadata", args.tokenizer_metadata, kind)
    if kind == "HuggingFaceTokenizer":
        path = _local_pretrained_dir(args.tokenizer_model)
        for flag, given in (("--vocab-file", args.vocab_file), ("--merge-file", args.merge_file)):
            if given is not None:
                _existing_file(flag, given, kind)
        _needs_transformers(kind)
        tokenizer = _readable(kind, "--tokenizer-model", path, lambda: megatron_core_tokenizer(args))
        if tokenizer.eod is None:
            raise UserError(f"--tokenizer-model: {path} names no end-of-document token: set \"eos_token\" "
                            "in its tokenizer_config.json")
        return tokenizer
    if kind == "NullTokenizer" and args.vocab_size is None:
        raise UserError("--vocab-size: required with --tokenizer-type NullTokenizer")
    if kind in SENTENCEPIECE_TYPES or kind == "TikTokenizer":
        _existing_file("--tokenizer-model", args.tokenizer_model, kind)
    return _readable(kind, "--tokenizer-model", args.tokenizer_model, lambda: megatron_core_tokenizer(args))


def vocab_size_before_padding(args, tokenizer) -> int:
    """The tokenizer's size, or --vocab-size where that asks for more rows."""
    size = tokenizer.vocab_size
    if args.vocab_size is None or args.tokenizer_type in SIZED_BY_VOCAB_SIZE_FLAG:
        return size
    if args.vocab_size < size:
        raise UserError(f"--vocab-size: {args.vocab_size} is smaller than the {args.tokenizer_type}'s "
                        f"{size} tokens")
    return args.vocab_size


def padded_vocab_size(args, tokenizer) -> int:
    """Rounded up to --make-vocab-size-divisible-by x TP, as Megatron-LM pads it."""
    given = getattr(args, "padded_vocab_size", None)  # Megatron-LM's --padded-vocab-size, if parsed
    if given is not None:
        needed = vocab_size_before_padding(args, tokenizer)
        if given < needed:  # a token id past the embedding's rows would fail mid-run
            raise UserError(f"--padded-vocab-size: {given} is smaller than the {needed} tokens of "
                            f"--tokenizer-type {args.tokenizer_type}")
        return given
    from megatron.training.model.sizes import vocab_size_with_padding

    return vocab_size_with_padding(vocab_size_before_padding(args, tokenizer), args.make_vocab_size_divisible_by,
                                   args.tensor_model_parallel_size)


def megatron_core_tokenizer(args):
    """megatron-core's own builder, given just the attributes it reads (its 0.16 names)."""
    from megatron.core.tokenizers.text.utils.build_tokenizer import build_tokenizer as build_mcore

    return build_mcore(SimpleNamespace(
        tokenizer_type=args.tokenizer_type, tokenizer_model=args.tokenizer_model,
        tokenizer_metadata=args.tokenizer_metadata, tokenizer_special_tokens=args.tokenizer_special_tokens,
        tokenizer_sentencepiece_legacy=args.tokenizer_sentencepiece_legacy,
        tiktoken_pattern=args.tiktoken_pattern, tiktoken_num_special_tokens=args.tiktoken_num_special_tokens,
        vocab_size=args.vocab_size, vocab_file=args.vocab_file, merge_file=args.merge_file,
        tokenizer_hf_use_fast=args.tokenizer_hf_use_fast, trust_remote_code=args.trust_remote_code,
        tokenizer_hf_include_special_tokens=args.tokenizer_hf_include_special_tokens))


def _gpt2_bpe_tokenizer(args, vocab: str, merges: str):
    """megatron-core's HuggingFace tokenizer on a GPT-2 directory made of --vocab-file and --merge-file.

    The keyword arguments are the ones megatron-core's builder gives its GPT-2 tokenizer, in its
    order, and the path is reset to the name that builder uses: the dataset cache key
    (``unique_identifiers``) is then Megatron-LM's for the same flags, the same on every rank and
    run rather than the temporary directory's name.
    """
    import tempfile

    from megatron.core.tokenizers import MegatronTokenizer

    with tempfile.TemporaryDirectory(prefix="gpt2-bpe-") as directory:
        os.symlink(os.path.abspath(vocab), os.path.join(directory, "vocab.json"))
        os.symlink(os.path.abspath(merges), os.path.join(directory, "merges.txt"))
        with open(os.path.join(directory, "tokenizer_config.json"), "w", encoding="utf-8") as f:
            # GPT2Tokenizer's defaults are GPT-2's: no prefix space, <|endoftext|> as BOS, EOS and UNK.
            json.dump({"tokenizer_class": "GPT2Tokenizer"}, f)
        tokenizer = MegatronTokenizer.from_pretrained(
            tokenizer_path=directory, metadata_path={"library": "huggingface"},
            additional_special_tokens=args.tokenizer_special_tokens or [], vocab_file=vocab, merges_file=merges,
            use_fast=args.tokenizer_hf_use_fast, trust_remote_code=args.trust_remote_code,
            include_special_tokens=args.tokenizer_hf_include_special_tokens)
    tokenizer.path = "GPT2BPETokenizer"
    return tokenizer


def hub_offline() -> None:
    """HuggingFace Hub offline mode, for this process and the ones it starts: local files only."""
    os.environ["HF_HUB_OFFLINE"] = "1"
    os.environ["TRANSFORMERS_OFFLINE"] = "1"
    constants = sys.modules.get("huggingface_hub.constants")
    if constants is not None:  # imported before us: it read the variables then
        constants.HF_HUB_OFFLINE = True


def _needs_transformers(kind: str) -> None:
    from megatron.training.runtime.optional_packages import require

    require(f"--tokenizer-type {kind}", "transformers")


def _has_gpt2_eod(vocab: str) -> None:
    """transformers would add a missing <|endoftext|> as a new token; Megatron-LM's GPT-2 needs it."""
    try:
        with open(vocab, encoding="utf-8") as f:
            tokens = json.load(f)
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
        raise UserError(f"--vocab-file: {vocab} could not be read as a GPT-2 vocab.json ({err})") from err
    if not isinstance(tokens, dict) or GPT2_EOD_TOKEN not in tokens:
        raise UserError(f"--vocab-file: {vocab} has no {GPT2_EOD_TOKEN} token (GPT-2's end of document)")


def _existing_file(flag: str, path, kind: str) -> str:
    if not path:
        raise UserError(f"{flag}: required with --tokenizer-type {kind}")
    if not os.path.isfile(path):
        raise UserError(f"{flag}: {path} is not a file")
    return path


def _local_pretrained_dir(path) -> str:
    if not path:
        raise UserError("--tokenizer-model: required with --tokenizer-type HuggingFaceTokenizer "
                        "(a local directory written by save_pretrained)")
    if os.path.isfile(path):
        raise UserError(f"--tokenizer-model: {path} is a file: HuggingFaceTokenizer takes the directory "
                        "written by save_pretrained")
    if not os.path.isdir(path):
        raise UserError(f"--tokenizer-model: {path} is not a local directory and nothing is downloaded "
                        "here: save the tokenizer with save_pretrained(DIR) where there is internet, "
                        "then pass DIR")
    names = os.listdir(path)
    # Without one of these transformers builds an empty tokenizer, or fails with a long message.
    if not any(name in HF_VOCABULARY_FILES or name.endswith(HF_VOCABULARY_SUFFIXES) for name in names):
        raise UserError(f"--tokenizer-model: {path} holds no tokenizer files (tokenizer.json, vocab.json, "
                        "vocab.txt, *.model): save the tokenizer there with save_pretrained")
    return path


def _readable(kind: str, flag: str, path, build):
    """Run ``build``; a file it cannot make sense of is one line naming the flag."""
    try:
        return build()
    except UserError:
        raise
    except Exception as err:  # the libraries raise anything from AssertionError to Rust panics
        if str(err).startswith(MCORE_HF_WRAPPER) and err.__context__ is not None:
            err = err.__context__  # transformers' own error, not megatron-core's restatement of it
        detail = str(err).strip().splitlines()[0] if str(err).strip() else _failed_check(err)
        if isinstance(err, KeyError):  # its message is just the key
            detail = f"no {detail}"
        raise UserError(f"{flag}: {path} could not be read as a {kind} ({detail})") from err


def _failed_check(err: BaseException) -> str:
    """A bare assertion's own source line: megatron-core's checks carry no message."""
    import traceback

    frame = traceback.extract_tb(err.__traceback__)[-1]
    return f"{type(err).__name__} at {os.path.basename(frame.filename)}:{frame.lineno}: {frame.line}"


def _positive_int(text: str) -> int:
    value = int(text)
    if value <= 0:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {text}")
    return value
