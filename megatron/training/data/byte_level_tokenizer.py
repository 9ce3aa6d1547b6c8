"""Our byte-level tokenizer: UTF-8 bytes are tokens 0..255, then EOD=256 and PAD=257.

Kept apart from megatron-core's byte-level library (EOS=0, PAD=1): .bin/.idx files written with
this one already exist, and their ids must keep their meaning. Nothing to download.
"""

from __future__ import annotations

from typing import Dict, List

from megatron.core.tokenizers import MegatronTokenizerBase


class ByteLevelTokenizer(MegatronTokenizerBase):
    """Bytes 0..255, then special tokens EOD=256 and PAD=257."""

    NUM_BYTES = 256

    def __init__(self):
        super().__init__(path="byte-level", config={})
        self._eod = self.NUM_BYTES
        self._pad = self.NUM_BYTES + 1
        # megatron-core serializes this into its dataset cache key: keep it stable.
        self.unique_identifiers = {"class": type(self).__name__, "vocab_size": self.vocab_size}

    def tokenize(self, text: str) -> List[int]:
        return list(text.encode("utf-8"))

    def detokenize(self, ids) -> str:
        return bytes(int(i) for i in ids if 0 <= int(i) < self.NUM_BYTES).decode("utf-8", errors="replace")

    @property
    def vocab(self) -> Dict[str, int]:
        vocab = {chr(i) if 32 <= i < 127 else f"<0x{i:02X}>": i for i in range(self.NUM_BYTES)}
        vocab.update({"<eod>": self._eod, "<pad>": self._pad})
        return vocab

    @property
    def inv_vocab(self) -> Dict[int, str]:
        return {v: k for k, v in self.vocab.items()}

    @property
    def vocab_size(self) -> int:
        return self.NUM_BYTES + 2

    @property
    def eod(self) -> int:
        return self._eod

    @property
    def eos(self) -> int:
        return self._eod

    @property
    def pad(self) -> int:
        return self._pad

    def apply_chat_template(self, *args, **kwargs):
        raise NotImplementedError("the byte-level tokenizer has no chat template")

    def __repr__(self) -> str:
        return f"ByteLevelTokenizer(vocab_size={self.vocab_size})"
