"""Our safetensors reader and incremental writer against the safetensors library, and the
converted-checkpoint reader's integrity checks."""
from __future__ import annotations

import json
import random
import shutil

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from k3_trtllm.checkpoint.hf import CheckpointError, HFCheckpoint
from k3_trtllm.checkpoint.safetensors_format import (SafetensorsFormatError, build_header, load_tensors,
                                                      read_header)
from k3_trtllm.checkpoint.trtllm import load_trtllm_state_dict, read_trtllm_config
from k3_trtllm.config import ConfigError
from k3_trtllm.convert import convert_checkpoint
from k3_trtllm.convert.plan import Entry
from k3_trtllm.convert.writer import RankFile


def test_reader_matches_safetensors_library(ckpt_dir):
    """Every tensor (nested names, vision skipped) and row ranges of a few, as safe_open reads them."""
    with HFCheckpoint(ckpt_dir("tiny-nested")) as ckpt:
        assert not any(n.startswith(("vision_tower.", "mm_projector.", "language_model.")) for n in ckpt.names())
        for name in sorted(ckpt.names()):
            info = ckpt.info(name)
            with safe_open(str(info.file), "pt") as f:
                expected = f.get_tensor(info.key)
            assert torch.equal(ckpt.read(name), expected), name
            if expected.dim() == 2 and expected.shape[0] > 3:
                assert torch.equal(ckpt.read(name, rows=(1, 3)), expected[1:3]), name


def test_incremental_writer_matches_safetensors_library(tmp_path):
    gen = torch.Generator().manual_seed(0)
    tensors = {"a": torch.randn(5, 7, generator=gen).bfloat16(), "b": torch.randint(0, 255, (3, 4, 2), generator=gen,
               dtype=torch.uint8), "c": torch.randn(11, generator=gen)}
    f = RankFile(tmp_path / "ours.safetensors", [Entry(n, t.dtype, tuple(t.shape)) for n, t in tensors.items()])
    pieces = [(n, i) for n, t in tensors.items() for i in range(t.shape[0])]
    random.Random(0).shuffle(pieces)  # rows arrive in any order
    for name, i in pieces:
        t = tensors[name]
        f.write(name, i * t[0].nbytes, t[i: i + 1])
    f.close()
    save_file(tensors, str(tmp_path / "library.safetensors"))
    for path in ("ours.safetensors", "library.safetensors"):
        with safe_open(str(tmp_path / path), "pt") as g:
            assert sorted(g.keys()) == sorted(tensors)
            for name, t in tensors.items():
                assert torch.equal(g.get_tensor(name), t)
        loaded = load_tensors(tmp_path / path)
        assert all(torch.equal(loaded[n], t) for n, t in tensors.items())


def test_writer_refuses_a_piece_outside_its_region(tmp_path):
    f = RankFile(tmp_path / "x.safetensors", [Entry("a", torch.float32, (4,))])
    with pytest.raises(RuntimeError, match="does not fit its region"):
        f.write("a", 8, torch.zeros(3))
    with pytest.raises(RuntimeError, match="wrote 0 of 16 data bytes"):
        f.close()


@pytest.mark.parametrize("damage,message", [
    (lambda raw: raw[:5], "truncated safetensors file (5 bytes, no header)"),
    (lambda raw: (10**6).to_bytes(8, "little") + raw[8:],
     "truncated safetensors file: header of 1000000 bytes does not fit in the file ({size} bytes)"),
    (lambda raw: (2).to_bytes(8, "little") + b"[]", "not a safetensors file (header is not a JSON object)"),
])
def test_header_damage_is_reported(damage, message, tmp_path):
    header, _ = build_header([("w", torch.float32, (2, 2))])
    path = tmp_path / "bad.safetensors"
    path.write_bytes(damage(header + bytes(16)))
    with pytest.raises(SafetensorsFormatError) as info:
        read_header(path)
    assert str(info.value) == f"{path}: " + message.format(size=path.stat().st_size)


def test_offsets_that_do_not_match_the_dtype_are_reported(tmp_path):
    body = json.dumps({"w": {"dtype": "F32", "shape": [2, 2], "data_offsets": [0, 12]}}).encode()
    path = tmp_path / "bad.safetensors"
    path.write_bytes(len(body).to_bytes(8, "little") + body + bytes(16))
    with pytest.raises(SafetensorsFormatError) as info:
        read_header(path)
    assert str(info.value) == f"{path}: tensor 'w': data_offsets [0, 12] do not hold 16 bytes of F32 [2, 2]"


@pytest.fixture(scope="module")
def converted_tp2(ckpt_dir, tmp_path_factory):
    out = tmp_path_factory.mktemp("trtllm") / "out"
    convert_checkpoint(ckpt_dir("tiny"), out, tp=2, progress=False)
    return out


def test_reader_checks_rank_files_against_the_manifest(converted_tp2, tmp_path):
    out = shutil.copytree(converted_tp2, tmp_path / "out")
    rank1 = out / "rank1.safetensors"
    raw = rank1.read_bytes()
    rank1.write_bytes(raw[:-1])
    data = len(raw) - 8 - int.from_bytes(raw[:8], "little")
    with pytest.raises(CheckpointError) as info:
        load_trtllm_state_dict(out, rank=1)
    assert str(info.value) == (f"{rank1}: truncated safetensors file: header declares {data} bytes of tensor data, "
                               f"the file holds {data - 1}")
    config = json.loads((out / "config.json").read_text())
    config["manifest"]["rank0"]["tensors"] += 1
    (out / "config.json").write_text(json.dumps(config))
    n = config["manifest"]["rank0"]["tensors"]
    size = config["manifest"]["rank0"]["file_bytes"]
    with pytest.raises(CheckpointError) as info:
        load_trtllm_state_dict(out, rank=0)
    assert str(info.value) == (f"{out / 'rank0.safetensors'}: holds {n - 1} tensors in {size} bytes, the "
                               f"config.json manifest records {n} in {size}")


def test_reader_checks_quantization_against_the_k3_config(converted_tp2, tmp_path):
    out = shutil.copytree(converted_tp2, tmp_path / "out")
    config = json.loads((out / "config.json").read_text())
    config["quantization"]["quant_algo"] = "W4A16_MXFP4"
    (out / "config.json").write_text(json.dumps(config))
    with pytest.raises(ConfigError) as info:
        read_trtllm_config(out)
    assert str(info.value) == (f"{out / 'config.json'}: field `quantization.quant_algo` = 'W4A16_MXFP4' disagrees "
                               "with `k3` (bf16 routed experts)")
