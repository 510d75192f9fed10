"""``k3-trt convert`` on the tiny synthetic checkpoints: what it writes is what the model
would build from the HF files (world 1), the shards of a TP/EP conversion are exactly
the world-1 tensors split the TensorRT-LLM way, and the converted model reproduces the
HF model's logits bit for bit. Every comparison here is exact: conversion only moves,
concatenates, casts losslessly (bf16 → fp32, fp32 → fp32) or dequantises MXFP4 (exact
in bf16), so there is nothing to tolerate."""
from __future__ import annotations

import errno
import json
import os

import pytest
import torch
from safetensors import safe_open
from helpers import dequantized_state

from k3_trtllm.checkpoint.hf import HFCheckpoint
from k3_trtllm.checkpoint.loader import load_hf_state_dict
from k3_trtllm.checkpoint.mapping import combine, targets
from k3_trtllm.checkpoint.trtllm import load_trtllm_state_dict
from k3_trtllm.convert import convert_checkpoint, reassemble
from k3_trtllm.model import build_step, load_model

BS = 16


@pytest.fixture(scope="module")
def converted(ckpt_dir, tmp_path_factory):
    """``converted(preset, tp, ep, experts=None, **options)`` -> output dir (cached)."""
    made = {}

    def make(preset: str, tp: int = 1, ep: int = 1, experts: str | None = None, **options):
        key = (preset, tp, ep, experts, tuple(sorted(options.items())))
        if key not in made:
            out = tmp_path_factory.mktemp("converted") / "out"
            convert_checkpoint(ckpt_dir(preset), out, tp, ep, experts=experts, progress=False, **options)
            made[key] = out
        return made[key]

    return make


def _assert_same_tensors(actual: dict, expected: dict) -> None:
    assert sorted(actual) == sorted(expected)
    for name, t in expected.items():
        assert actual[name].dtype == t.dtype and actual[name].shape == t.shape, name
        assert torch.equal(actual[name], t), name


def _prefill_then_decode(model) -> torch.Tensor:
    """Logits of a 21-token prefill (every position) then 4 decode steps."""
    ids = torch.randint(3, 1024, (25,), generator=torch.Generator().manual_seed(7)).tolist()
    caches, table = model.allocate_caches(4, BS, 1), [0, 1]
    rows = [model(build_step([(ids[:21], 0, 0, table)], BS, logits_all=True), caches, decode=False)]
    rows += [model(build_step([([ids[i]], i, 0, table)], BS), caches, decode=True) for i in range(21, 25)]
    return torch.cat(rows)


@pytest.mark.parametrize("preset", ["tiny", "tiny-mxfp4", "tiny-nested"])
def test_world1_checkpoint_holds_the_hf_loader_tensors(preset, ckpt_dir, converted):
    _, hf = load_hf_state_dict(ckpt_dir(preset))
    _, state, _ = load_trtllm_state_dict(converted(preset))
    _assert_same_tensors(state, hf)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("preset", ["tiny", "tiny-mxfp4", "tiny-nested"])
def test_world1_logits_equal_hf_reference(preset, dtype, ckpt_dir, converted):
    reference = _prefill_then_decode(load_model(ckpt_dir(preset), dtype=dtype))
    ours = _prefill_then_decode(load_model(converted(preset), dtype=dtype))
    assert torch.equal(ours, reference)


def test_bf16_experts_from_mxfp4_equal_hf_model(ckpt_dir, converted):
    """--experts bf16: dequantised at convert time instead of inside the model — exact."""
    out = converted("tiny-mxfp4", experts="bf16")
    config = json.loads((out / "config.json").read_text())
    assert config["quantization"]["quant_algo"] is None and "quantization_config" not in config["k3"]
    _, hf = load_hf_state_dict(ckpt_dir("tiny-mxfp4"))
    _assert_same_tensors(load_trtllm_state_dict(out)[1], dequantized_state(hf))
    reference = _prefill_then_decode(load_model(ckpt_dir("tiny-mxfp4")))
    assert torch.equal(_prefill_then_decode(load_model(out)), reference)


SHARDINGS = [("tiny", 2, 1, None), ("tiny", 2, 2, None), ("tiny", 4, 2, None),
             ("tiny-mxfp4", 2, 1, None), ("tiny-mxfp4", 4, 2, None), ("tiny-mxfp4", 2, 1, "bf16")]


@pytest.mark.parametrize("preset,tp,ep,experts", SHARDINGS)
def test_shards_reassemble_to_world1(preset, tp, ep, experts, converted):
    _, whole, _ = load_trtllm_state_dict(converted(preset, experts=experts))
    _, reassembled = reassemble(converted(preset, tp, ep, experts))
    _assert_same_tensors(reassembled, whole)


def _trtllm_slice(part, tensor, rank: int, tp: int, ep: int) -> torch.Tensor | None:
    """A rank's slice of an HF part, written from TensorRT-LLM's Mapping rules directly
    (moe_ep_rank = rank % ep, moe_tp_rank = rank // ep, experts contiguous per EP rank)."""
    if part.expert is None:
        index, count = rank, tp
    else:
        per_rank = 8 // ep  # tiny has 8 experts
        if part.expert // per_rank != rank % ep:
            return None
        index, count = rank // ep, tp // ep
    if part.split == "replicate":
        return tensor
    return tensor.chunk(count, dim=0 if part.split == "rows" else 1)[index]


@pytest.mark.parametrize("preset,tp,ep,experts", SHARDINGS)
def test_rank_tensors_are_the_table_applied_to_local_slices(preset, tp, ep, experts, ckpt_dir, converted):
    """Rank r's tensor = combine(target, r's slices of the HF parts), target by target."""
    out = converted(preset, tp, ep, experts)
    with HFCheckpoint(ckpt_dir(preset)) as ckpt:
        cfg = ckpt.config
        hf = {n: ckpt.read(n) for n in ckpt.names()}
        ranks = [load_trtllm_state_dict(out, r)[1] for r in range(tp)]
        for target in targets(cfg, dequantize_experts=experts == "bf16"):
            for r in range(tp):
                local = [_trtllm_slice(p, hf[p.source].reshape(p.shape), r, tp, ep) for p in target.parts]
                expected = combine(target, [x for x in local if x is not None], cfg)
                assert torch.equal(ranks[r][target.name], expected), (target.name, r)


def test_tensor_parallel_mlps_sum_to_the_full_mlp(converted):
    """The row/column pairing is usable for TP: with --tp 4 --ep 2, the dense MLP summed
    over 4 ranks and one routed expert summed over its 2 MoE-TP ranks equal the world-1
    MLPs. fp64 sums of 4 partial products: agreement to 1e-12 relative."""
    whole = load_trtllm_state_dict(converted("tiny"))[1]
    ranks = [load_trtllm_state_dict(converted("tiny", 4, 2), r)[1] for r in range(4)]
    x = torch.randn(5, 128, generator=torch.Generator().manual_seed(0), dtype=torch.float64)

    def mlp(fc, proj, inp):
        gate, up = fc.double().chunk(2, dim=0)
        return (torch.nn.functional.silu(inp @ gate.T) * (inp @ up.T)) @ proj.double().T

    dense = "transformer.layers.0.mlp."
    full = mlp(whole[dense + "fc.weight"], whole[dense + "proj.weight"], x)
    parts = sum(mlp(s[dense + "fc.weight"], s[dense + "proj.weight"], x) for s in ranks)
    torch.testing.assert_close(parts, full, rtol=1e-12, atol=1e-12)
    # expert 5 lives on EP rank 1 (ranks 1 and 3: moe_tp ranks 0 and 1), local index 1
    e = "transformer.layers.1.mlp.experts."
    lat = x[:, :64]
    full = mlp(whole[e + "w13.weight"][5], whole[e + "w2.weight"][5], lat)
    parts = sum(mlp(ranks[r][e + "w13.weight"][1], ranks[r][e + "w2.weight"][1], lat) for r in (1, 3))
    torch.testing.assert_close(parts, full, rtol=1e-12, atol=1e-12)


def test_config_records_mapping_quantization_and_manifest(converted):
    out = converted("tiny-mxfp4", 4, 2)
    config = json.loads((out / "config.json").read_text())
    assert config["architecture"] == "KimiK3ForCausalLM" and config["dtype"] == "bfloat16"
    assert config["mapping"] == {"world_size": 4, "tp_size": 4, "pp_size": 1, "cp_size": 1, "moe_tp_size": 2,
                                 "moe_ep_size": 2, "moe_cluster_size": 1}
    assert config["quantization"]["quant_algo"] == "W4A16_MXFP4"
    assert config["k3"]["quantization_config"]["format"] == "mxfp4-pack-quantized"
    assert [p["attention"] for p in config["layer_plan"]].count("mla") == 3
    for r in range(4):
        path = out / f"rank{r}.safetensors"
        with safe_open(str(path), "pt") as f:
            names = list(f.keys())
            data = sum(f.get_tensor(n).nbytes for n in names)
        assert config["manifest"][f"rank{r}"] == {"tensors": len(names), "bytes": data,
                                                  "file_bytes": path.stat().st_size}


def test_row_chunks_and_worker_threads_write_identical_files(converted):
    """Forcing 1 KiB row chunks and 3 threads (pieces finishing in any order) must give
    byte-identical rank files to the default run, where tiny tensors are never chunked."""
    default = converted("tiny-mxfp4", 2, 1)
    chunked = converted("tiny-mxfp4", 2, 1, workers=3, chunk_bytes=1024)
    for r in range(2):
        assert (chunked / f"rank{r}.safetensors").read_bytes() == (default / f"rank{r}.safetensors").read_bytes()


def test_kernel_copy_and_tensor_path_write_identical_files(ckpt_dir, converted, tmp_path, monkeypatch):
    """Stored-as-is bytes go file to file through copy_file_range; where the kernel refuses
    (EXDEV across filesystems), the tensor path must write the very same bytes."""
    real, calls = os.copy_file_range, []

    def counting(*args):
        calls.append(args)
        return real(*args)

    monkeypatch.setattr(os, "copy_file_range", counting)
    default = converted("tiny-mxfp4", 2, 1)
    convert_checkpoint(ckpt_dir("tiny-mxfp4"), tmp_path / "kernel", 2, 1, progress=False)
    assert calls

    def refuse(*args):
        raise OSError(errno.EXDEV, "cross-device")

    monkeypatch.setattr(os, "copy_file_range", refuse)
    convert_checkpoint(ckpt_dir("tiny-mxfp4"), tmp_path / "tensor", 2, 1, progress=False)
    for r in range(2):
        expected = (default / f"rank{r}.safetensors").read_bytes()
        assert (tmp_path / "kernel" / f"rank{r}.safetensors").read_bytes() == expected
        assert (tmp_path / "tensor" / f"rank{r}.safetensors").read_bytes() == expected
