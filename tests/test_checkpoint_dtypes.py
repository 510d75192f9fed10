"""Real K3 files vary in their float dtypes (issue 15 item 5, spec §5.4 erratum): a float
tensor stored in any float dtype is cast to the dtype the model keeps, by the one rule of
the transformation table, in the HF loader and in ``convert`` alike; MXFP4 scales typed
F8_E8M0 are their U8 bytes. The reference is the "matching" checkpoint, stored in the
spec's dtypes: a variant holding the same values in other dtypes must give bitwise the
same model tensors and logits."""
from __future__ import annotations

import json
import math
import re

import pytest
import torch
from safetensors.torch import load_file, save_file

from k3_trtllm.checkpoint.hf import CheckpointError, HFCheckpoint
from k3_trtllm.checkpoint.loader import load_hf_state_dict
from k3_trtllm.checkpoint.mapping import ROW_WISE, targets
from k3_trtllm.checkpoint.safetensors_format import element_size
from k3_trtllm.checkpoint.synth import preset_config, synth_tensors, write_checkpoint
from k3_trtllm.checkpoint.trtllm import load_trtllm_state_dict
from k3_trtllm.config import load_config, parse_config
from k3_trtllm.convert import convert_checkpoint
from k3_trtllm.checkpoint.rank_layout import RankLayout
from k3_trtllm.convert.plan import Planner
from k3_trtllm.convert.reassemble import reassemble
from k3_trtllm.model import build_step, load_model

BS = 8
O_NORM = "model.layers.1.self_attn.o_norm.weight"


def _kept_exactly(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``t`` with values that ``dtype`` represents exactly (so casts both ways are exact)."""
    return t.to(dtype).to(t.dtype)


def _variant_dtype(name: str) -> torch.dtype | None:
    """How the variant stores each tensor (None: as the matching checkpoint does)."""
    if name.endswith(("_conv1d.weight", "A_log", "dt_bias")):
        return torch.bfloat16  # spec fp32
    if name.endswith(("q_a_layernorm.weight", "e_score_correction_bias")):
        return torch.float16  # spec bf16 / fp32
    if name.endswith(("norm.weight", "_res_proj.weight", "gate.weight", "kv_b_proj.weight")) or name in (
            "lm_head.weight", "model.layers.1.self_attn.q_proj.weight"):
        return torch.float32  # spec bf16 (o_norm: spec fp32, the variant holds the bf16 the model keeps)
    return None


def _pair(tmp_path):
    config = preset_config("tiny")
    cfg = parse_config(config)
    matching = synth_tensors(cfg, seed=3)
    variant = {}
    for name, t in matching.items():
        dtype = _variant_dtype(name)
        if name.endswith("o_norm.weight"):
            variant[name] = t.bfloat16()  # a downcast in the file; the model rounds the same way
            continue
        if dtype is None or t.dtype == torch.uint8:
            variant[name] = t
            continue
        if t.dtype == torch.float32:
            matching[name] = t = _kept_exactly(t, dtype)
        assert torch.equal(t.to(dtype).to(t.dtype), t), name  # the variant holds the same values
        variant[name] = t.to(dtype)
    assert {t.dtype for t in variant.values()} >= {torch.bfloat16, torch.float16, torch.float32}
    return (write_checkpoint(tmp_path / "matching", config, matching),
            write_checkpoint(tmp_path / "variant", config, variant))


def _logits(path) -> torch.Tensor:
    model = load_model(path, dtype=torch.bfloat16)
    ids = torch.randint(3, 1024, (20,), generator=torch.Generator().manual_seed(1)).tolist()
    return model(build_step([(ids, 0, 0, [0, 1, 2])], BS, logits_all=True), model.allocate_caches(4, BS, 1),
                 decode=False)


def _equal_states(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    for name in a:
        assert a[name].dtype == b[name].dtype and torch.equal(a[name], b[name]), name


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    return _pair(tmp_path_factory.mktemp("dtypes"))


def test_hf_loader_casts_any_float_dtype_to_the_kept_one(pair):
    matching, variant = pair
    _equal_states(load_hf_state_dict(matching)[1], load_hf_state_dict(variant)[1])
    assert torch.equal(_logits(matching), _logits(variant))


@pytest.mark.parametrize("tp", [1, 2])
def test_convert_casts_alike_and_the_converted_model_gives_the_same_logits(pair, tmp_path, tp):
    matching, variant = pair
    outs = [tmp_path / f"{p.name}-tp{tp}" for p in pair]
    for src, out in zip(pair, outs):
        convert_checkpoint(src, out, tp=tp, progress=False, chunk_bytes=4096)  # row chunks of cast parts
    for rank in range(tp):
        _equal_states(load_trtllm_state_dict(outs[0], rank)[1], load_trtllm_state_dict(outs[1], rank)[1])
    _equal_states(reassemble(outs[1])[1], load_hf_state_dict(matching)[1])
    if tp == 1:
        assert torch.equal(_logits(outs[1]), _logits(matching))


def test_downcasts_round_to_nearest_even(tmp_path):
    """An fp32 o_norm gain (the model keeps bf16, whose spacing on [1, 2) is 2^-7) at and
    around the midpoints between bf16 values, with the values worked out by hand."""
    config = preset_config("tiny")
    tensors = synth_tensors(parse_config(config))
    stored = [1 + 2**-8, 1 + 3 * 2**-8, 1 + 2**-8 + 2**-20, -(1 + 2**-8), 3 + 2**-7, 1 + 2**-7]
    expected = [1.0, 1 + 2**-6, 1 + 2**-7, -1.0, 3.0, 1 + 2**-7]  # ties go to the even significand
    o_norm = tensors[O_NORM].clone()
    o_norm[: len(stored)] = torch.tensor(stored, dtype=torch.float64).float()
    tensors[O_NORM] = o_norm
    hf = write_checkpoint(tmp_path / "hf", config, tensors)
    convert_checkpoint(hf, tmp_path / "out", progress=False)
    target = "transformer.layers.1.attention.o_norm.weight"
    for state in (load_hf_state_dict(hf)[1], load_trtllm_state_dict(tmp_path / "out")[1]):
        kept = state[target]
        assert kept.dtype == torch.bfloat16
        assert kept[: len(stored)].double().tolist() == expected


def test_mxfp4_scales_typed_e8m0_are_their_u8_bytes(tmp_path):
    config = preset_config("tiny-mxfp4")
    tensors = synth_tensors(parse_config(config), seed=2)
    matching = write_checkpoint(tmp_path / "u8", config, tensors)
    e8m0 = {n: t.view(torch.float8_e8m0fnu) if n.endswith(".weight_scale") else t for n, t in tensors.items()}
    variant = write_checkpoint(tmp_path / "e8m0", config, e8m0)
    with HFCheckpoint(variant) as ckpt:  # the file really types them F8_E8M0
        assert {ckpt.info(n).dtype for n in ckpt.names() if n.endswith(".weight_scale")} == {torch.float8_e8m0fnu}
    _equal_states(load_hf_state_dict(matching)[1], load_hf_state_dict(variant)[1])
    for experts in ("mxfp4", "bf16"):  # scale bytes copied, and scale bytes decoded
        outs = [tmp_path / f"{p.name}-{experts}" for p in (matching, variant)]
        for src, out in zip((matching, variant), outs):
            convert_checkpoint(src, out, experts=experts, progress=False)
        _equal_states(load_trtllm_state_dict(outs[0])[1], load_trtllm_state_dict(outs[1])[1])


def test_mxfp4_packed_bytes_stay_strict(tmp_path):
    config = preset_config("tiny-mxfp4")
    tensors = synth_tensors(parse_config(config), seed=2)
    name = next(n for n in tensors if n.endswith(".weight_packed"))
    tensors[name] = tensors[name].view(torch.int8)
    hf = write_checkpoint(tmp_path / "hf", config, tensors)
    with pytest.raises(CheckpointError, match=re.escape(f"tensor '{name}' has dtype int8, expected uint8") + "$"):
        load_hf_state_dict(hf)


def test_a_converted_checkpoint_holds_exactly_the_kept_dtypes(ckpt_dir, tmp_path):
    """A converted file is read as written: a tensor in another dtype is refused, not run in it."""
    out = tmp_path / "out"
    convert_checkpoint(ckpt_dir("tiny"), out, progress=False)
    rank0 = out / "rank0.safetensors"
    tensors = load_file(str(rank0))
    tensors["transformer.ln_f.weight"] = tensors["transformer.ln_f.weight"].float()
    save_file(tensors, str(rank0))
    config = json.loads((out / "config.json").read_text())
    config["manifest"]["rank0"]["file_bytes"] = rank0.stat().st_size
    (out / "config.json").write_text(json.dumps(config))
    with pytest.raises(CheckpointError) as info:
        load_model(out)
    assert str(info.value) == "tensor 'transformer.ln_f.weight': dtype float32, expected bfloat16"


def test_pieces_read_at_most_chunk_bytes_of_the_stored_dtype(ckpt_dir):
    """Row chunks are sized by the bytes the file holds: fp32-stored bf16 parts read half the rows."""
    cfg = load_config(ckpt_dir("tiny"))
    chunk = 8192
    for file_dtype in (None, torch.float32, torch.float64):
        stored = {p.source: file_dtype for t in targets(cfg) for p in t.parts if file_dtype is not None
                  and p.dtypes[0] == torch.bfloat16}
        planner = Planner(cfg, RankLayout(1, 1, cfg.moe.num_experts), list(targets(cfg)), chunk, file_dtypes=stored)
        for piece in planner.pieces():
            if piece.target.combine not in ROW_WISE or piece.rows is None or piece.rows[1] - piece.rows[0] == 1:
                continue  # whole parts by design; or one row, the least a piece reads
            row = sum(math.prod(p.shape[1:]) * element_size(stored.get(p.source, p.dtypes[0])) for p in piece.parts)
            assert (piece.rows[1] - piece.rows[0]) * row <= chunk, piece.target.name
