"""Bad inputs to ``k3-trt convert``: one test each, asserting the exact message and that
nothing is left behind — neither OUT_DIR nor the temp dir beside it."""
from __future__ import annotations

import json
import shutil

import pytest
import torch
from click.testing import CliRunner

import k3_trtllm.convert.run as convert_run
from k3_trtllm.checkpoint.hf import CheckpointError
from k3_trtllm.checkpoint.synth import preset_config, synth_tensors, write_checkpoint
from k3_trtllm.cli import main
from k3_trtllm.config import ConfigError, parse_config
from k3_trtllm.convert import ConvertError, convert_checkpoint
from k3_trtllm.utils.atomic import MARKER, OutputError


@pytest.fixture(scope="module")
def tiny_tensors():
    return synth_tensors(parse_config(preset_config("tiny")))


def _variant(tmp_path, tensors, config=None, name="ckpt"):
    return write_checkpoint(tmp_path / name, config or preset_config("tiny"), tensors)


def _shard_of(ckpt, tensor: str) -> str:
    return json.loads((ckpt / "model.safetensors.index.json").read_text())["weight_map"][tensor]


def _fails(hf, out, error, message, **options):
    """Convert must raise ``error`` with exactly ``message`` and leave out.parent as it was."""
    before = sorted(p.name for p in out.parent.iterdir())
    with pytest.raises(error) as info:
        convert_checkpoint(hf, out, progress=False, **options)
    assert str(info.value) == message
    assert sorted(p.name for p in out.parent.iterdir()) == before


@pytest.fixture
def out(tmp_path):
    (tmp_path / "outputs").mkdir()
    return tmp_path / "outputs" / "out"


def test_truncated_shard(ckpt_dir, tmp_path, out):
    hf = shutil.copytree(ckpt_dir("tiny"), tmp_path / "ckpt")
    shard = sorted(hf.glob("*.safetensors"))[-1]
    raw = shard.read_bytes()
    data = len(raw) - 8 - int.from_bytes(raw[:8], "little")
    shard.write_bytes(raw[:-100])
    _fails(hf, out, CheckpointError, f"{shard}: truncated safetensors file: header declares {data} bytes of tensor "
                                     f"data, the file holds {data - 100}")


def test_missing_tensor(tiny_tensors, tmp_path, out):
    tensors = dict(tiny_tensors)
    del tensors["model.layers.0.mlp.up_proj.weight"]
    hf = _variant(tmp_path, tensors)
    _fails(hf, out, CheckpointError, f"{hf}: checkpoint does not match config.json\n"
                                     "  missing 1 tensor(s): model.layers.0.mlp.up_proj.weight")


def test_unexpected_tensor(tiny_tensors, tmp_path, out):
    tensors = dict(tiny_tensors, **{"model.layers.0.mlp.extra_proj.weight": torch.zeros(4, 4, dtype=torch.bfloat16)})
    hf = _variant(tmp_path, tensors)
    _fails(hf, out, CheckpointError, f"{hf}: checkpoint does not match config.json\n"
                                     "  unexpected 1 tensor(s): model.layers.0.mlp.extra_proj.weight")


def test_missing_and_unexpected_reported_together(tiny_tensors, tmp_path, out):
    tensors = dict(tiny_tensors)
    for name in ("lm_head.weight", "model.norm.weight"):
        del tensors[name]
    tensors["model.layers.0.self_attn.typo_proj.weight"] = torch.zeros(4, 4, dtype=torch.bfloat16)
    hf = _variant(tmp_path, tensors)
    _fails(hf, out, CheckpointError, f"{hf}: checkpoint does not match config.json\n"
                                     "  missing 2 tensor(s): lm_head.weight, model.norm.weight\n"
                                     "  unexpected 1 tensor(s): model.layers.0.self_attn.typo_proj.weight")


def test_wrong_shape(tiny_tensors, tmp_path, out):
    hf = _variant(tmp_path, dict(tiny_tensors, **{"lm_head.weight": torch.zeros(1024, 129, dtype=torch.bfloat16)}))
    _fails(hf, out, CheckpointError, f"{hf}: 1 tensor(s) do not match config.json\n"
                                     f"  {_shard_of(hf, 'lm_head.weight')}: tensor 'lm_head.weight' has shape "
                                     "[1024, 129], expected [1024, 128] from config.json")


def test_wrong_dtype(tiny_tensors, tmp_path, out):
    # Any float dtype is accepted for a float tensor (spec §5.4 erratum); an integer one is not.
    name = "model.layers.0.self_attn.A_log"
    hf = _variant(tmp_path, dict(tiny_tensors, **{name: tiny_tensors[name].to(torch.int32)}))
    _fails(hf, out, CheckpointError, f"{hf}: 1 tensor(s) do not match config.json\n"
                                     f"  {_shard_of(hf, name)}: tensor '{name}' has dtype int32, expected float32 or "
                                     "bfloat16 or float16 or float64")


def test_index_names_missing_shard(ckpt_dir, tmp_path, out):
    hf = shutil.copytree(ckpt_dir("tiny"), tmp_path / "ckpt")
    shard = sorted(hf.glob("*.safetensors"))[1]
    shard.unlink()
    _fails(hf, out, CheckpointError,
           f"{hf / 'model.safetensors.index.json'}: names shard(s) that do not exist: {shard.name}")


def test_inconsistent_config(ckpt_dir, tmp_path, out):
    hf = shutil.copytree(ckpt_dir("tiny"), tmp_path / "ckpt")
    config = json.loads((hf / "config.json").read_text())
    config["num_experts_per_token"] = 9
    (hf / "config.json").write_text(json.dumps(config))
    _fails(hf, out, ConfigError,
           f"{hf / 'config.json'}: field `num_experts_per_token` = 9: expected at most num_experts = 8")


def test_tp_not_dividing_heads_vocab_and_intermediates(ckpt_dir, out):
    _fails(ckpt_dir("tiny"), out, CheckpointError, "cannot shard the model with --tp 3 --ep 1:\n"
           "  linear_attn_config.num_heads = 4 is not divisible by --tp 3\n"
           "  num_attention_heads = 4 is not divisible by --tp 3\n"
           "  vocab_size = 1024 is not divisible by --tp 3\n"
           "  shared expert intermediate size (moe_intermediate_size * num_shared_experts) = 128 is not divisible "
           "by --tp 3\n"
           "  moe_intermediate_size = 64 is not divisible by moe_tp_size (--tp 3 / --ep 1) = 3", tp=3)


def test_ep_not_dividing_tp(ckpt_dir, out):
    _fails(ckpt_dir("tiny"), out, CheckpointError, "--tp 2 is not divisible by --ep 4 (expert parallelism subdivides "
           "the tensor-parallel ranks: moe_tp_size = tp / ep)", tp=2, ep=4)


def test_ep_not_dividing_experts(ckpt_dir, out):
    _fails(ckpt_dir("tiny"), out, CheckpointError, "cannot shard the model with --tp 16 --ep 16:\n"
           "  linear_attn_config.num_heads = 4 is not divisible by --tp 16\n"
           "  num_attention_heads = 4 is not divisible by --tp 16\n"
           "  num_experts = 8 is not divisible by --ep 16", tp=16, ep=16)


def test_mxfp4_moe_tp_slice_must_keep_scale_groups(ckpt_dir, out):
    _fails(ckpt_dir("tiny-mxfp4"), out, CheckpointError, "cannot shard the model with --tp 4 --ep 1:\n"
           "  moe_intermediate_size = 64 split over moe_tp_size 4 (--tp 4 / --ep 1) gives 16 per rank, not a "
           "multiple of 32 (MXFP4 scale groups)", tp=4)


def test_mxfp4_requested_from_bf16_experts(ckpt_dir, out):
    _fails(ckpt_dir("tiny"), out, ConvertError, "--experts mxfp4: the checkpoint's routed experts are bf16; k3-trt "
           "converts MXFP4 to bf16 but does not quantise", experts="mxfp4")


def test_existing_out_dir_needs_force(ckpt_dir, out):
    """--force replaces only what k3-trt convert wrote; a directory of the user's stays."""
    out.mkdir()
    (out / "keep.txt").write_text("mine")
    _fails(ckpt_dir("tiny"), out, FileExistsError, f"{out}: already exists (pass --force to replace it)")
    _fails(ckpt_dir("tiny"), out, OutputError, f"{out}: not replaced: it has no {MARKER}, so k3-trt did not write it "
           "(remove it yourself or choose another output)", force=True)
    assert sorted(p.name for p in out.iterdir()) == ["keep.txt"] and (out / "keep.txt").read_text() == "mine"
    (out / "keep.txt").unlink()
    out.rmdir()
    convert_checkpoint(ckpt_dir("tiny"), out, progress=False)
    convert_checkpoint(ckpt_dir("tiny"), out, tp=2, force=True, progress=False)
    assert sorted(p.name for p in out.iterdir()) == [MARKER, "config.json", "rank0.safetensors", "rank1.safetensors"]
    assert sorted(p.name for p in out.parent.iterdir()) == ["out"]


@pytest.mark.parametrize("workers", [1, 3])
@pytest.mark.parametrize("interrupt", [KeyboardInterrupt, RuntimeError])
def test_interrupted_run_leaves_nothing(interrupt, workers, ckpt_dir, out, monkeypatch):
    """Ctrl-C (or any error) half way: no OUT_DIR, no temp dir, and a --force target (an
    earlier conversion) intact byte for byte."""
    convert = convert_run.convert_piece
    calls = []

    def flaky(piece, *args):
        calls.append(piece)
        if len(calls) == 40:
            raise interrupt("stop")
        return convert(piece, *args)

    earlier = {}
    for force in (False, True):
        if force:  # the target: an earlier conversion, made without interruption
            monkeypatch.setattr(convert_run, "convert_piece", convert)
            convert_checkpoint(ckpt_dir("tiny"), out, progress=False)
            earlier = {p.name: p.read_bytes() for p in out.iterdir()}
        monkeypatch.setattr(convert_run, "convert_piece", flaky)
        before = sorted(p.name for p in out.parent.iterdir())
        calls.clear()
        with pytest.raises(interrupt):
            convert_checkpoint(ckpt_dir("tiny"), out, tp=2, workers=workers, force=force, progress=False)
        assert 40 <= len(calls) < 60  # stopped where interrupted (a tp=2 tiny run has 715 pieces)
        assert sorted(p.name for p in out.parent.iterdir()) == before
    assert {p.name: p.read_bytes() for p in out.iterdir()} == earlier


def test_cli_end_to_end(ckpt_dir, out):
    runner = CliRunner()
    ok = runner.invoke(main, ["convert", str(ckpt_dir("tiny-mxfp4")), str(out), "--tp", "2", "--ep", "2", "--quiet"])
    assert ok.exit_code == 0, ok.output
    assert ok.output.strip() == str(out)
    assert sorted(p.name for p in out.iterdir()) == [MARKER, "config.json", "rank0.safetensors", "rank1.safetensors"]
    again = runner.invoke(main, ["convert", str(ckpt_dir("tiny-mxfp4")), str(out)])
    assert again.exit_code == 1
    assert f"Error: {out}: already exists (pass --force to replace it)" in again.output
    bad = runner.invoke(main, ["convert", str(ckpt_dir("tiny")), str(out.parent / "other"), "--tp", "2", "--ep", "4"])
    assert bad.exit_code == 1
    assert "Error: --tp 2 is not divisible by --ep 4" in bad.output
    assert sorted(p.name for p in out.parent.iterdir()) == ["out"]
