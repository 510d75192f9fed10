"""Text <-> token ids: tiktoken for K3 checkpoints, bytes for the synthetic tiny models (a fallback
that ``run`` and ``serve`` announce)."""
from __future__ import annotations

import base64
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
    kind: str  # what --json and the logs call it: "tiktoken" or "byte-fallback"

    def encode(self, text: str, *, parse_special_tokens: bool = False) -> list[int]: ...

    def decode(self, ids: list[int]) -> str: ...


class ByteTokenizer:
    """UTF-8 bytes shifted by 3. Ids that are no byte (pad/bos/eos or beyond 258)
    decode to nothing; broken UTF-8 decodes to U+FFFD. It has no special tokens."""

    kind = "byte-fallback"

    def encode(self, text: str, *, parse_special_tokens: bool = False) -> list[int]:
        return [b + BYTE_OFFSET for b in text.encode("utf-8")]

    def decode(self, ids: list[int]) -> str:
        data = bytes(i - BYTE_OFFSET for i in ids if BYTE_OFFSET <= i < BYTE_OFFSET + 256)
        return data.decode("utf-8", errors="replace")


class TiktokenTokenizer:
    """K3's tokenizer: ``tiktoken.model`` (base64 token, rank per line) plus the special
    tokens that ``tokenizer_config.json`` lists in ``added_tokens_decoder``. Without
    that file the K3 layout still holds: the 256 ids after the BPE ranks are special
    tokens, then unnamed (``<|reserved_token_ID|>``)."""

    kind = "tiktoken"

    def __init__(self, model_dir: str | Path) -> None:
        try:
            import tiktoken
        except ImportError as e:
            raise RuntimeError(f"{model_dir} ships a tiktoken tokenizer; install it with "
                               "`pip install tiktoken`") from e
        model_dir = Path(model_dir)
        bpe_file, config_file = model_dir / TIKTOKEN_FILE, model_dir / TOKENIZER_CONFIG_FILE
        ranks = _read_bpe_ranks(bpe_file)
        named = _named_special_tokens(config_file) if config_file.is_file() else {}
        first = len(ranks)
        below = sorted(i for i in named if i < first)
        if below:
            raise ValueError(f"{config_file}: added_tokens_decoder ids {below[:5]} overlap the {first} BPE ranks "
                             f"of {bpe_file}")
        last = max([first + NUM_RESERVED_SPECIAL_TOKENS - 1, *named])
        special = {named.get(i, f"<|reserved_token_{i}|>"): i for i in range(first, last + 1)}
        self._encoding = tiktoken.Encoding(name=model_dir.name, pat_str=K3_SPLIT_PATTERN,
                                           mergeable_ranks=ranks, special_tokens=special)
        self._num_ids = last + 1

    def encode(self, text: str, *, parse_special_tokens: bool = False) -> list[int]:
        # By default special-token text in a prompt ("<|im_end|>" typed by a user) is
        # ordinary text, so that nobody injects control tokens through a prompt; chat
        # markup built by a trusted template asks for parse_special_tokens.
        if parse_special_tokens:
            return self._encoding.encode(text, allowed_special="all")
        return self._encoding.encode(text, allowed_special=set(), disallowed_special=())

    def decode(self, ids: list[int]) -> str:
        known = [i for i in ids if 0 <= i < self._num_ids]
        return self._encoding.decode_bytes(known).decode("utf-8", errors="replace")


def _read_bpe_ranks(path: Path) -> dict[bytes, int]:
    """``tiktoken.model``: one ``base64(token) rank`` per line. Read here rather than with
    tiktoken's loader, which keeps a copy of every file it reads in a cache under the
    temp dir keyed by the path, so a replaced file would load stale."""
    ranks: dict[bytes, int] = {}
    for n, line in enumerate(path.read_bytes().splitlines(), 1):
        if not line.strip():
            continue
        try:
            token, rank = line.split()
            ranks[base64.b64decode(token, validate=True)] = int(rank)
        except ValueError:  # not two fields, bad base64 (binascii.Error), a rank that is no integer
            raise ValueError(f"{path}:{n}: expected 'base64-token rank', got {line[:60]!r}") from None
    if not ranks:
        raise ValueError(f"{path}: holds no tokens")
    if sorted(ranks.values()) != list(range(len(ranks))):
        raise ValueError(f"{path}: ranks must be 0..{len(ranks) - 1}, each once")
    return ranks


def _named_special_tokens(config_file: Path) -> dict[int, str]:
    try:
        config = json.loads(config_file.read_text())
        return {int(i): str(entry["content"]) for i, entry in config.get("added_tokens_decoder", {}).items()}
    except (OSError, ValueError, TypeError, KeyError, AttributeError) as e:
        raise ValueError(f"{config_file}: cannot read added_tokens_decoder ({type(e).__name__}: {e})") from None


def tokenizer_fallback_reason(model_dir: str | Path) -> str | None:
    """Why ``load_tokenizer(model_dir)`` falls back to the byte tokenizer, or None when
    it loads the K3 tokenizer. Cheap: looks at files only."""
    model_dir = Path(model_dir)
    if (model_dir / TIKTOKEN_FILE).is_file():
        return None
    return (f"{model_dir} has no {TIKTOKEN_FILE}: using the byte tokenizer (UTF-8 bytes as ids 3-258), whose "
            "text is not the K3 tokenizer's")


def load_tokenizer(model_dir: str | Path) -> Tokenizer:
    """The K3 tokenizer when ``model_dir`` has one, else the byte tokenizer (callers
    report ``tokenizer_fallback_reason``)."""
    if tokenizer_fallback_reason(model_dir) is None:
        return TiktokenTokenizer(model_dir)
    return ByteTokenizer()
