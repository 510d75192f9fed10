"""Byte tokenizer and the K3 tiktoken tokenizer."""
import base64
import builtins
import json

import pytest

from k3_trtllm.runtime.tokenizer import (K3_SPLIT_PATTERN, ByteTokenizer, TiktokenTokenizer,
                                         load_tokenizer)


def test_byte_tokenizer_round_trip_and_unknown_ids():
    tok = ByteTokenizer()
    text = "héllo, 世界 \n"
    ids = tok.encode(text)
    assert ids == [b + 3 for b in text.encode("utf-8")]
    assert tok.decode(ids) == text
    # pad/bos/eos and ids past the byte range decode to nothing.
    assert tok.decode([1, *ids[:2], 0, 2, 259, 1000, *ids[2:]]) == text
    # A cut multi-byte character decodes to U+FFFD instead of raising.
    assert tok.decode(tok.encode("é")[:1]) == "\ufffd"


def test_k3_split_pattern_pieces():
    regex = pytest.importorskip("regex")
    pieces = regex.compile(K3_SPLIT_PATTERN, flags=regex.V1).findall(
        "Hello WORLD's 12345 你好世界!!\n\n  x don't")
    assert pieces == ["Hello", " WORLD's", " ", "123", "45", " ", "你好世界", "!!\n\n", " ", " x", " don't"]


def write_toy_tiktoken(path):
    """Byte-level BPE over 256 bytes plus merges he, ll, llo, hello; two named specials."""
    ranks = {bytes([i]): i for i in range(256)}
    for merged in (b"he", b"ll", b"llo", b"hello"):
        ranks[merged] = len(ranks)
    lines = [f"{base64.b64encode(t).decode()} {r}" for t, r in ranks.items()]
    (path / "tiktoken.model").write_text("\n".join(lines) + "\n")
    (path / "tokenizer_config.json").write_text(json.dumps(
        {"added_tokens_decoder": {"260": {"content": "[BOS]"}, "261": {"content": "[EOS]"}}}))


def test_tiktoken_tokenizer_merges_specials_and_unknown_ids(tmp_path):
    pytest.importorskip("tiktoken")
    write_toy_tiktoken(tmp_path)
    tok = load_tokenizer(tmp_path)
    assert isinstance(tok, TiktokenTokenizer)
    ids = tok.encode("hello hello[EOS]")
    assert ids == [259, 32, 259, 261]
    assert tok.decode(ids + [10**6]) == "hello hello[EOS]"
    assert tok.decode([ord("h"), ord("e")]) == tok.decode([256]) == "he"


def test_tiktoken_missing_is_a_clear_error(tmp_path, monkeypatch):
    write_toy_tiktoken(tmp_path)
    real_import = builtins.__import__

    def no_tiktoken(name, *args, **kwargs):
        if name.startswith("tiktoken"):
            raise ImportError("No module named 'tiktoken'")
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_tiktoken)
    with pytest.raises(RuntimeError, match="pip install tiktoken"):
        load_tokenizer(tmp_path)


def test_model_dir_without_tiktoken_files_uses_bytes(tmp_path):
    (tmp_path / "tiktoken.model").write_text("")  # without tokenizer_config.json: not K3's tokenizer
    assert isinstance(load_tokenizer(tmp_path), ByteTokenizer)
