"""Megatron-LM's tokenizer flags: define them, build the tokenizer they name, pad its vocabulary.

SentencePiece (SentencePieceTokenizer, GPTSentencePieceTokenizer, Llama2Tokenizer), TikTokenizer
and NullTokenizer are megatron-core's own (``megatron.core.tokenizers``), built as Megatron-LM
builds them. GPT2BPETokenizer and HuggingFaceTokenizer read the same files with the
``tokenizers`` library (see hf_tokenizers_adapter: megatron-core would need transformers and the
internet). ByteLevelTokenizer is ours, and the default: the quickstart and the mock data use it.
Nothing is ever downloaded; a missing file is one line naming its flag.
"""

from __future__ import annotations

import argparse
import os
from types import SimpleNamespace

from megatron.training.errors import UserError

BYTE_LEVEL = "ByteLevelTokenizer"
SENTENCEPIECE_TYPES = ("SentencePieceTokenizer", "GPTSentencePieceTokenizer", "Llama2Tokenizer")
TOKENIZER_TYPES = (BYTE_LEVEL, "GPT2BPETokenizer", "HuggingFaceTokenizer", *SENTENCEPIECE_TYPES,
                   "TikTokenizer", "NullTokenizer")
# For these --vocab-size is the tokenizer's own size, as in Megatron-LM; for the others it is a
# floor on the vocabulary before padding (room for tokens the tokenizer does not have yet).
SIZED_BY_VOCAB_SIZE_FLAG = ("TikTokenizer", "NullTokenizer")


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
                            "HuggingFaceTokenizer: a local directory holding tokenizer.json")
    group.add_argument("--tokenizer-metadata", default=None,
                       help="megatron-core tokenizer metadata (JSON file) for SentencePiece/TikTokenizer")
    group.add_argument("--tokenizer-special-tokens", nargs="+", default=None,
                       help="TikTokenizer: must include <unk> <s> </s> <mask> <pad> <cls> <sep>; "
                            "SentencePiece: needs --tokenizer-sentencepiece-legacy")
    group.add_argument("--tiktoken-pattern", choices=["v1", "v2"], default=None)
    group.add_argument("--tiktoken-num-special-tokens", type=_positive_int, default=1000)
    group.add_argument("--tokenizer-sentencepiece-legacy", action="store_true")
    group.add_argument("--tokenizer-hf-use-fast", action="store_true",
                       help="accepted for Megatron-LM command lines: the tokenizers library is the fast one")
    group.add_argument("--tokenizer-hf-include-special-tokens", action="store_true",
                       help="HuggingFaceTokenizer: add the tokenizer's special tokens (e.g. BOS) when encoding")
    group.add_argument("--trust-remote-code", action="store_true",
                       help="accepted for Megatron-LM command lines: tokenizer.json runs no code")


def build_tokenizer(args):
    """The tokenizer --tokenizer-type names; a missing or unreadable file is a UserError."""
    kind = args.tokenizer_type or BYTE_LEVEL
    if kind == BYTE_LEVEL:
        from megatron.training.byte_level_tokenizer import ByteLevelTokenizer

        return ByteLevelTokenizer()
    if kind == "GPT2BPETokenizer":
        from megatron.training.hf_tokenizers_adapter import TokenizersLibraryTokenizer

        vocab = _existing_file("--vocab-file", args.vocab_file, kind)
        merges = _existing_file("--merge-file", args.merge_file, kind)
        return _readable(kind, "--vocab-file", vocab,
                         lambda: TokenizersLibraryTokenizer.from_gpt2_files(vocab, merges))
    if kind == "HuggingFaceTokenizer":
        from megatron.training.hf_tokenizers_adapter import TokenizersLibraryTokenizer

        path = _local_pretrained_path(args.tokenizer_model)
        return _readable(kind, "--tokenizer-model", path, lambda: TokenizersLibraryTokenizer.from_pretrained_dir(
            path, add_special_tokens=args.tokenizer_hf_include_special_tokens))
    if kind == "NullTokenizer" and args.vocab_size is None:
        raise UserError("--vocab-size: required with --tokenizer-type NullTokenizer")
    if kind in SENTENCEPIECE_TYPES or kind == "TikTokenizer":
        _existing_file("--tokenizer-model", args.tokenizer_model, kind)
    if args.tokenizer_metadata is not None:
        _existing_file("--tokenizer-metadata", args.tokenizer_metadata, kind)
    return _readable(kind, "--tokenizer-model", args.tokenizer_model, lambda: _megatron_core_tokenizer(args))


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
        return given
    from megatron.training.model_arithmetic import vocab_size_with_padding

    return vocab_size_with_padding(vocab_size_before_padding(args, tokenizer), args.make_vocab_size_divisible_by,
                                   args.tensor_model_parallel_size)


def _megatron_core_tokenizer(args):
    """megatron-core's own builder, given just the attributes it reads (its 0.16 names)."""
    from megatron.core.tokenizers.text.utils.build_tokenizer import build_tokenizer as build_mcore

    return build_mcore(SimpleNamespace(
        tokenizer_type=args.tokenizer_type, tokenizer_model=args.tokenizer_model,
        tokenizer_metadata=args.tokenizer_metadata, tokenizer_special_tokens=args.tokenizer_special_tokens,
        tokenizer_sentencepiece_legacy=args.tokenizer_sentencepiece_legacy,
        tiktoken_pattern=args.tiktoken_pattern, tiktoken_num_special_tokens=args.tiktoken_num_special_tokens,
        vocab_size=args.vocab_size))


def _existing_file(flag: str, path, kind: str) -> str:
    if not path:
        raise UserError(f"{flag}: required with --tokenizer-type {kind}")
    if not os.path.isfile(path):
        raise UserError(f"{flag}: {path} is not a file")
    return path


def _local_pretrained_path(path) -> str:
    if not path:
        raise UserError("--tokenizer-model: required with --tokenizer-type HuggingFaceTokenizer "
                        "(a local directory holding tokenizer.json)")
    if not os.path.exists(path):
        raise UserError(f"--tokenizer-model: {path} is not a local directory and nothing is downloaded "
                        "here: save the tokenizer with save_pretrained(DIR) where there is internet, "
                        "then pass DIR")
    return path


def _readable(kind: str, flag: str, path, build):
    """Run ``build``; a file it cannot make sense of is one line naming the flag."""
    try:
        return build()
    except UserError:
        raise
    except Exception as err:  # the libraries raise anything from AssertionError to Rust panics
        detail = str(err).strip().splitlines()[0] if str(err).strip() else _failed_check(err)
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
