"""GPT2BPETokenizer and HuggingFaceTokenizer read with the ``tokenizers`` library.

megatron-core 0.16.1 builds both through ``transformers.AutoTokenizer``, which is not one of our
dependencies, and which fetches the GPT-2 files from the internet when --vocab-file is missing.
The ``tokenizers`` library (the engine behind HuggingFace's fast tokenizers) reads the same files
offline and gives the same ids: GPT-2's byte-level BPE from vocab.json + merges.txt, or any
tokenizer saved with ``save_pretrained`` (tokenizer.json) from a local directory.
"""

from __future__ import annotations

import json
import os
from typing import Dict, List, Optional

from megatron.core.tokenizers import MegatronTokenizerBase

GPT2_EOD_TOKEN = "<|endoftext|>"
# Where a tokenizer directory names its end-of-text token, first found wins.
_EOS_SOURCES = ("tokenizer_config.json", "special_tokens_map.json")
_COMMON_EOS_TOKENS = ("<|endoftext|>", "</s>", "<|end_of_text|>", "<eos>")


class TokenizersLibraryTokenizer(MegatronTokenizerBase):
    """A ``tokenizers.Tokenizer`` behind megatron-core's tokenizer interface."""

    def __init__(self, tokenizer, eod_token: str, source: str, add_special_tokens: bool = False):
        super().__init__(path=source, config={})
        self._tokenizer = tokenizer
        self._add_special_tokens = add_special_tokens
        self._eod = tokenizer.token_to_id(eod_token)
        if self._eod is None:
            raise ValueError(f"its vocabulary has no end-of-document token {eod_token!r}")
        self._eod_token = eod_token
        # megatron-core puts this into its dataset cache key.
        self.unique_identifiers = {"class": type(self).__name__, "source": source,
                                   "vocab_size": self.vocab_size, "eod": self._eod,
                                   "add_special_tokens": add_special_tokens}

    @classmethod
    def from_gpt2_files(cls, vocab_file: str, merge_file: str) -> "TokenizersLibraryTokenizer":
        """GPT-2's tokenizer: byte-level BPE, no prefix space, <|endoftext|> ends a document."""
        from tokenizers import Tokenizer, decoders, models, pre_tokenizers

        tokenizer = Tokenizer(models.BPE.from_file(vocab_file, merge_file))
        tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        tokenizer.decoder = decoders.ByteLevel()
        return cls(tokenizer, GPT2_EOD_TOKEN, source=f"{vocab_file}+{merge_file}")

    @classmethod
    def from_pretrained_dir(cls, path: str, add_special_tokens: bool = False) -> "TokenizersLibraryTokenizer":
        """A directory written by ``save_pretrained`` (or a tokenizer.json file itself)."""
        from tokenizers import Tokenizer

        json_file = path if os.path.isfile(path) else os.path.join(path, "tokenizer.json")
        if not os.path.isfile(json_file):
            raise FileNotFoundError(f"{path} has no tokenizer.json (save it with a fast tokenizer's "
                                    "save_pretrained)")
        tokenizer = Tokenizer.from_file(json_file)
        eod_token = _eos_token_of(os.path.dirname(json_file), tokenizer)
        return cls(tokenizer, eod_token, source=os.path.abspath(json_file),
                   add_special_tokens=add_special_tokens)

    def tokenize(self, text: str) -> List[int]:
        return self._tokenizer.encode(text, add_special_tokens=self._add_special_tokens).ids

    def detokenize(self, ids) -> str:
        return self._tokenizer.decode([int(i) for i in ids], skip_special_tokens=False)

    @property
    def vocab(self) -> Dict[str, int]:
        return self._tokenizer.get_vocab(with_added_tokens=True)

    @property
    def inv_vocab(self) -> Dict[int, str]:
        return {v: k for k, v in self.vocab.items()}

    @property
    def vocab_size(self) -> int:
        return self._tokenizer.get_vocab_size(with_added_tokens=True)

    @property
    def eod(self) -> int:
        return self._eod

    @property
    def eos(self) -> int:
        return self._eod

    @property
    def pad(self) -> Optional[int]:
        return None

    def apply_chat_template(self, *args, **kwargs):
        raise NotImplementedError("chat templates need transformers; pretraining does not use them")

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.path!r}, vocab_size={self.vocab_size}, eod={self._eod})"


def _eos_token_of(directory: str, tokenizer) -> str:
    """The end-of-text token a saved tokenizer declares, else a well-known one in its vocabulary."""
    for name in _EOS_SOURCES:
        path = os.path.join(directory, name)
        if not os.path.isfile(path):
            continue
        with open(path, encoding="utf-8") as f:
            token = json.load(f).get("eos_token")
        if isinstance(token, dict):  # {"content": "</s>", ...} in older files
            token = token.get("content")
        if token:
            return token
    for token in _COMMON_EOS_TOKENS:
        if tokenizer.token_to_id(token) is not None:
            return token
    raise ValueError(f"no eos_token in {' or '.join(_EOS_SOURCES)} and none of "
                     f"{', '.join(_COMMON_EOS_TOKENS)} in its vocabulary")
