"""`k3-trt build` refuses bad input with a clear message and leaves no partial output."""
from __future__ import annotations

import importlib.util
import shutil

import pytest
from click.testing import CliRunner

from k3_trtllm.cli import main


def _build(ckpt, out, *extra):
    result = CliRunner().invoke(main, ["build", str(ckpt), str(out), "--builder", "none", *extra])
    return result.exit_code, result.output


def test_missing_checkpoint_dir(tmp_path):
    code, output = _build(tmp_path / "nope", tmp_path / "out")
    assert code == 1 and "checkpoint directory not found" in output
    assert not (tmp_path / "out").exists()


def test_missing_weight_shard(ckpt_dir, tmp_path):
    ckpt = tmp_path / "ckpt"
    shutil.copytree(ckpt_dir("tiny"), ckpt)
    shard = sorted(ckpt.glob("*.safetensors"))[0]
    shard.unlink()
    code, output = _build(ckpt, tmp_path / "out")
    assert code == 1 and "error:" in output and shard.name in output, output
    assert not (tmp_path / "out").exists() and list(tmp_path.iterdir()) == [ckpt]


@pytest.mark.parametrize("limits, message", [
    (["--max-seq-len", "100000"], "max_position_embeddings"),
    (["--max-batch-size", "16", "--max-num-tokens", "8"], "must be >= max_batch_size"),
    (["--block-size", "0"], "block_size must be >= 1"),
    (["--max-batch-size", "1", "--max-seq-len", "64", "--max-num-tokens", "128"], "exceeds max_batch_size * max_seq_len"),
])
def test_limits_that_do_not_fit(ckpt_dir, tmp_path, limits, message):
    code, output = _build(ckpt_dir("tiny"), tmp_path / "out", *limits)
    assert code == 1 and message in output, output
    assert not (tmp_path / "out").exists()


def test_existing_output_needs_force(ckpt_dir, tmp_path):
    (tmp_path / "out").mkdir()
    code, output = _build(ckpt_dir("tiny"), tmp_path / "out")
    assert code == 1 and "--force" in output


def test_unavailable_builder_names_both_install_routes(ckpt_dir, tmp_path):
    if importlib.util.find_spec("tensorrt") is not None:
        pytest.skip("TensorRT proper is installed here")
    result = CliRunner().invoke(main, ["build", str(ckpt_dir("tiny")), str(tmp_path / "out"), "--builder", "tensorrt"])
    assert result.exit_code == 1
    assert "tensorrt-rtx-cu13-bindings" in result.output and "pip install tensorrt" in result.output
