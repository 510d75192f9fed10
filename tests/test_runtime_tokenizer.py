"""Byte tokenizer and the K3 tiktoken tokenizer."""
import base64
import builtins
import json

import pytest

from k3_trtllm.runtime.tokenizer import (K3_SPLIT_PATTERN, ByteTokenizer, TiktokenTokenizer,
                                         load_tokenizer, tokenizer_fallback_reason)


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


def write_toy_tiktoken(path, merges=(b"he", b"ll", b"llo", b"hello"), config=True):
    """Byte-level BPE over 256 bytes plus ``merges`` (ids 256...); two named specials right after."""
    ranks = {bytes([i]): i for i in range(256)}
    for merged in merges:
        ranks[merged] = len(ranks)
    lines = [f"{base64.b64encode(t).decode()} {r}" for t, r in ranks.items()]
    (path / "tiktoken.model").write_text("\n".join(lines) + "\n")
    if config:
        (path / "tokenizer_config.json").write_text(json.dumps(
            {"added_tokens_decoder": {"260": {"content": "[BOS]"}, "261": {"content": "[EOS]"}}}))


def test_tiktoken_tokenizer_merges_specials_and_unknown_ids(tmp_path):
    pytest.importorskip("tiktoken")
    write_toy_tiktoken(tmp_path)
    tok = load_tokenizer(tmp_path)
    assert isinstance(tok, TiktokenTokenizer)
    ids = tok.encode("hello hello[EOS]", parse_special_tokens=True)
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


def test_model_dir_without_tiktoken_model_falls_back_to_bytes_and_says_why(tmp_path):
    (tmp_path / "tokenizer_config.json").write_text("{}")
    tok = load_tokenizer(tmp_path)
    assert isinstance(tok, ByteTokenizer) and tok.kind == "byte-fallback"
    assert "has no tiktoken.model" in tokenizer_fallback_reason(tmp_path)


def test_special_token_text_in_a_prompt_is_text_unless_asked(tmp_path):
    pytest.importorskip("tiktoken")
    write_toy_tiktoken(tmp_path)
    tok = load_tokenizer(tmp_path)
    typed = tok.encode("[EOS]<|reserved_token_300|>")
    assert 261 not in typed and 300 not in typed and tok.decode(typed) == "[EOS]<|reserved_token_300|>"
    assert typed == [b for b in b"[EOS]<|reserved_token_300|>"]  # plain bytes: no merge applies
    assert tok.encode("[EOS]<|reserved_token_300|>", parse_special_tokens=True) == [261, 300]
    assert ByteTokenizer().encode("[EOS]", parse_special_tokens=True) == ByteTokenizer().encode("[EOS]")


def test_tiktoken_model_without_tokenizer_config_uses_the_k3_special_layout(tmp_path):
    pytest.importorskip("tiktoken")
    write_toy_tiktoken(tmp_path, config=False)
    assert tokenizer_fallback_reason(tmp_path) is None
    tok = load_tokenizer(tmp_path)
    assert isinstance(tok, TiktokenTokenizer) and tok.kind == "tiktoken"
    assert tok.encode("hello") == [259]
    # The 256 ids after the 260 BPE ranks are (unnamed) special tokens.
    assert tok.encode("<|reserved_token_260|><|reserved_token_515|>", parse_special_tokens=True) == [260, 515]
    assert tok.decode([259, 516]) == "hello"  # 516 is past the special range: unknown


@pytest.mark.parametrize("content, message", [
    ("", "holds no tokens"), ("aGk= 0\nnot-base64! 1\n", r"tiktoken.model:2: expected 'base64-token rank'"),
    ("aGk= 0\naGk=\n", r"tiktoken.model:2: expected"), ("aGk= 0\naA== 5\n", "ranks must be 0..1"),
])
def test_broken_tiktoken_model_is_a_clear_error(tmp_path, content, message):
    pytest.importorskip("tiktoken")
    (tmp_path / "tiktoken.model").write_text(content)
    with pytest.raises(ValueError, match=message):
        load_tokenizer(tmp_path)


def test_broken_tokenizer_config_is_a_clear_error(tmp_path):
    pytest.importorskip("tiktoken")
    write_toy_tiktoken(tmp_path)
    (tmp_path / "tokenizer_config.json").write_text('{"added_tokens_decoder": {"x": {}}}')
    with pytest.raises(ValueError, match="tokenizer_config.json: cannot read added_tokens_decoder"):
        load_tokenizer(tmp_path)
    (tmp_path / "tokenizer_config.json").write_text('{"added_tokens_decoder": {"7": {"content": "[X]"}}}')
    with pytest.raises(ValueError, match=r"ids \[7\] overlap the 260 BPE ranks"):
        load_tokenizer(tmp_path)


def test_a_replaced_tiktoken_model_is_read_again(tmp_path):
    """tiktoken's own loader caches files by path in the temp dir; the tokenizer must not."""
    pytest.importorskip("tiktoken")
    write_toy_tiktoken(tmp_path)
    assert load_tokenizer(tmp_path).encode("hello") == [259]
    write_toy_tiktoken(tmp_path, merges=(b"lo", b"he"))
    assert load_tokenizer(tmp_path).encode("hello") == [257, 108, 256]


def checkpoint_with_tokenizer(ckpt_dir, tmp_path):
    import shutil

    hf = tmp_path / "hf"
    shutil.copytree(ckpt_dir("tiny"), hf)
    write_toy_tiktoken(hf)
    (hf / "generation_config.json").write_text('{"eos_token_id": 2}')
    (hf / "special_tokens_map.json").write_text('{"eos_token": "[EOS]"}')
    return hf


def test_convert_copies_the_tokenizer_and_generation_files(ckpt_dir, tmp_path):
    pytest.importorskip("tiktoken")
    from k3_trtllm.convert.run import convert_checkpoint

    hf = checkpoint_with_tokenizer(ckpt_dir, tmp_path)
    convert_checkpoint(hf, tmp_path / "out", progress=False)
    out = tmp_path / "out"
    for name in ("tiktoken.model", "tokenizer_config.json", "generation_config.json", "special_tokens_map.json"):
        assert (out / name).read_bytes() == (hf / name).read_bytes() and not (out / name).is_symlink()
    assert not (out / "tokenizer.json").exists()  # only what the checkpoint has
    assert tokenizer_fallback_reason(out) is None
    tok = load_tokenizer(out)
    assert tok.kind == "tiktoken" and tok.encode("hello[EOS]", parse_special_tokens=True) == [259, 261]


def test_convert_refuses_a_tokenizer_file_linking_out_of_the_checkpoint(ckpt_dir, tmp_path):
    from k3_trtllm.checkpoint.errors import CheckpointError
    from k3_trtllm.convert.run import convert_checkpoint

    hf = checkpoint_with_tokenizer(ckpt_dir, tmp_path)
    secret = tmp_path / "secret.txt"
    secret.write_text("not for the output")
    (hf / "tokenizer.json").symlink_to(secret)
    with pytest.raises(CheckpointError, match=r"tokenizer.json: tokenizer file resolves to .*secret.txt, outside"):
        convert_checkpoint(hf, tmp_path / "out", progress=False)
    assert not (tmp_path / "out").exists()


def run_json(model_dir):
    from click.testing import CliRunner

    from k3_trtllm.cli.run import run

    result = CliRunner().invoke(run, [str(model_dir), "--prompt", "hello", "--max-new-tokens", "2", "--json",
                                      "--device", "cpu", "--dtype", "float32", "--num-blocks", "8", "--max-slots", "2",
                                      "--max-seq-len", "64"])
    assert result.exit_code == 0, result.output
    return json.loads(result.stdout), result.stderr


def test_run_says_when_it_falls_back_to_bytes(ckpt_dir, tmp_path):
    pytest.importorskip("tiktoken")
    from k3_trtllm.convert.run import convert_checkpoint

    out, stderr = run_json(ckpt_dir("tiny"))
    assert out["tokenizer"] == "byte-fallback"
    warnings = [line for line in stderr.splitlines() if "byte tokenizer" in line]
    assert warnings == [f"k3-trt: warning: {ckpt_dir('tiny')} has no tiktoken.model: using the byte tokenizer "
                        "(UTF-8 bytes as ids 3-258), whose text is not the K3 tokenizer's"]
    hf = checkpoint_with_tokenizer(ckpt_dir, tmp_path)
    convert_checkpoint(hf, tmp_path / "out", progress=False)
    for model_dir in (hf, tmp_path / "out"):
        out, stderr = run_json(model_dir)
        assert out["tokenizer"] == "tiktoken" and "byte tokenizer" not in stderr
        assert out["outputs"][0]["prompt_ids"] == [259]  # "hello" is one merged token
