"""Text <-> token ids: bytes for the synthetic tiny models, tiktoken for K3 checkpoints."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Protocol

BYTE_OFFSET = 3  # ids 0, 1, 2 are pad, bos, eos; byte b is id b + 3
TIKTOKEN_FILE = "tiktoken.model"
TOKENIZER_CONFIG_FILE = "tokenizer_config.json"

# K3's pre-tokenizer split (the Kimi tiktoken pattern): Han runs, cased words with
# English contractions, 1-3 digit groups, punctuation runs, newlines, other spaces.
_LETTERS_NOT_HAN_UPPER = r"[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]"
_LETTERS_NOT_HAN_LOWER = r"[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]"
_CONTRACTION = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
K3_SPLIT_PATTERN = "|".join([
    r"[\p{Han}]+",
    rf"[^\r\n\p{{L}}\p{{N}}]?{_LETTERS_NOT_HAN_UPPER}*{_LETTERS_NOT_HAN_LOWER}+{_CONTRACTION}",
    rf"[^\r\n\p{{L}}\p{{N}}]?{_LETTERS_NOT_HAN_UPPER}+{_LETTERS_NOT_HAN_LOWER}*{_CONTRACTION}",
    r"\p{N}{1,3}",
    r" ?[^\s\p{L}\p{N}]+[\r\n]*",
    r"\s*[\r\n]+",
    r"\s+(?!\S)",
    r"\s+",
])
# Ids right after the BPE ranks are special tokens; tokenizer_config.json names some.
NUM_RESERVED_SPECIAL_TOKENS = 256


class Tokenizer(Protocol):
    def encode(self, text: str) -> list[int]: ...

    def decode(self, ids: list[int]) -> str: ...


class ByteTokenizer:
    """UTF-8 bytes shifted by 3. Ids that are no byte (pad/bos/eos or beyond 258)
    decode to nothing; broken UTF-8 decodes to U+FFFD."""

    def encode(self, text: str) -> list[int]:
        return [b + BYTE_OFFSET for b in text.encode("utf-8")]

    def decode(self, ids: list[int]) -> str:
        data = bytes(i - BYTE_OFFSET for i in ids if BYTE_OFFSET <= i < BYTE_OFFSET + 256)
        return data.decode("utf-8", errors="replace")


class TiktokenTokenizer:
    """K3's tokenizer: ``tiktoken.model`` (base64 token, rank per line) plus the special
    tokens that ``tokenizer_config.json`` lists in ``added_tokens_decoder``."""

    def __init__(self, model_dir: str | Path) -> None:
        try:
            import tiktoken
            from tiktoken.load import load_tiktoken_bpe
        except ImportError as e:
            raise RuntimeError(f"{model_dir} ships a tiktoken tokenizer; install it with "
                               "`pip install tiktoken`") from e
        model_dir = Path(model_dir)
        ranks = load_tiktoken_bpe(str(model_dir / TIKTOKEN_FILE))
        config = json.loads((model_dir / TOKENIZER_CONFIG_FILE).read_text())
        named = {int(i): entry["content"] for i, entry in config.get("added_tokens_decoder", {}).items()}
        first = len(ranks)
        last = max([first + NUM_RESERVED_SPECIAL_TOKENS - 1, *named])
        special = {named.get(i, f"<|reserved_token_{i}|>"): i for i in range(first, last + 1)}
        self._encoding = tiktoken.Encoding(name=model_dir.name, pat_str=K3_SPLIT_PATTERN,
                                           mergeable_ranks=ranks, special_tokens=special)
        self._num_ids = last + 1

    def encode(self, text: str) -> list[int]:
        # Special-token text in a prompt (chat markup) maps to its id.
        return self._encoding.encode(text, allowed_special="all")

    def decode(self, ids: list[int]) -> str:
        known = [i for i in ids if 0 <= i < self._num_ids]
        return self._encoding.decode_bytes(known).decode("utf-8", errors="replace")


def load_tokenizer(model_dir: str | Path) -> Tokenizer:
    """The K3 tokenizer when ``model_dir`` has one, else the byte tokenizer."""
    model_dir = Path(model_dir)
    if (model_dir / TIKTOKEN_FILE).is_file() and (model_dir / TOKENIZER_CONFIG_FILE).is_file():
        return TiktokenTokenizer(model_dir)
    return ByteTokenizer()
