"""Tokenizers: raw UTF-8 bytes (the default, nothing to load) or a Hugging Face `tokenizer.json`."""
from __future__ import annotations

from pathlib import Path
from typing import Protocol

import torch

from megatronapp.files import BadFile, read_bounded, short

MAX_TOKENIZER_BYTES = 256 << 20  # the largest tokenizer.json files in use are tens of MB

class Tokenizer(Protocol):
    vocab_size: int

    def encode(self, text: str) -> list[int]:
        """Token ids of `text`."""

    def decode(self, ids: list[int]) -> str:
        """Text of token ids."""


class ByteTokenizer:
    """One token per UTF-8 byte; vocabulary of 256."""

    vocab_size = 256
    name = "byte"

    def encode(self, text: str) -> list[int]:
        """UTF-8 bytes of `text` as ints."""
        return list(text.encode("utf-8"))

    def decode(self, ids: list[int]) -> str:
        """Text of byte ids; bytes that are not valid UTF-8 become U+FFFD."""
        return bytes(int(i) & 0xFF for i in ids).decode("utf-8", errors="replace")

    def encode_tensor(self, text: str) -> torch.Tensor:
        """1-D LongTensor of the bytes of `text`, without a Python list in between (large corpora)."""
        raw = bytearray(text.encode("utf-8"))
        if not raw:
            return torch.empty(0, dtype=torch.long)
        return torch.frombuffer(raw, dtype=torch.uint8).long()


class HFTokenizer:
    """A `tokenizers` library tokenizer read from tokenizer.json (the file, or a directory holding it)."""

    def __init__(self, path: str | Path):
        from tokenizers import Tokenizer as _Tok

        p = Path(path)
        if p.is_dir():
            p = p / "tokenizer.json"
        if not p.is_file():
            raise FileNotFoundError(f"tokenizer file {p} does not exist; give a tokenizer.json file, a directory "
                                    f"holding one, or 'byte'")
        try:
            text = read_bounded(p, MAX_TOKENIZER_BYTES, "tokenizer.json").decode("utf-8")
            self._tok = _Tok.from_str(text)
        except BadFile as e:
            raise ValueError(f"tokenizer file {e}") from None
        except Exception as e:  # noqa: BLE001 - the library raises a bare Exception on malformed JSON
            # its message may quote the file (a field of any length): cut, never echoed whole
            raise ValueError(f"tokenizer file {p} could not be read as a Hugging Face tokenizer.json: "
                             f"{short(e)}") from None
        self.path = p
        self.name = str(p)
        self.vocab_size = self._tok.get_vocab_size(with_added_tokens=True)

    def to_json(self) -> str:
        """The tokenizer as tokenizer.json text, written from what was parsed (not a copy of the file's bytes)."""
        return self._tok.to_str(pretty=True)

    def encode(self, text: str) -> list[int]:
        """Token ids of `text` (no special tokens added)."""
        return self._tok.encode(text, add_special_tokens=False).ids

    def decode(self, ids: list[int]) -> str:
        """Text of token ids."""
        return self._tok.decode([int(i) for i in ids], skip_special_tokens=False)

    def encode_tensor(self, text: str) -> torch.Tensor:
        """1-D LongTensor of the ids of `text`, encoded line by line in parallel batches."""
        lines = text.splitlines(keepends=True)
        ids: list[int] = []
        for enc in self._tok.encode_batch(lines, add_special_tokens=False):
            ids.extend(enc.ids)
        return torch.tensor(ids, dtype=torch.long)


def load_tokenizer(spec: str) -> ByteTokenizer | HFTokenizer:
    """'byte' for the byte tokenizer, else a path to tokenizer.json or a directory holding it."""
    if spec == "byte":
        return ByteTokenizer()
    return HFTokenizer(spec)
