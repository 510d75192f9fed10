"""Config parsing and validation: one test per rule, each with a broken config and the
exact field named in the error; layer plans checked against the spec's own listings."""
from __future__ import annotations

import copy
import json

import pytest

from k3_trtllm.checkpoint.loader import expected_sources
from k3_trtllm.checkpoint.synth import MXFP4_QUANT, TINY, preset_config
from k3_trtllm.config import ConfigError, load_config, parse_config


def tiny(**changes):
    cfg = copy.deepcopy(TINY)
    cfg.update(changes)
    return cfg


def k3_text_config():
    """The real K3 text config as given by spec §1/§2 (full_attn_layers 4, 8, ..., 92, 93)."""
    full = list(range(4, 93, 4)) + [93]
    cfg = copy.deepcopy(TINY)
    cfg.update(
        vocab_size=163840, hidden_size=7168, intermediate_size=33792, num_hidden_layers=93,
        num_attention_heads=96, q_lora_rank=1536, kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64,
        v_head_dim=128, num_experts=896, num_experts_per_token=16, num_shared_experts=2,
        moe_intermediate_size=3072, routed_expert_hidden_size=3584, attn_res_block_size=12,
        quantization_config=copy.deepcopy(MXFP4_QUANT),
        linear_attn_config=dict(kda_layers=[i for i in range(1, 94) if i not in full], full_attn_layers=full,
                                num_heads=96, head_dim=128, short_conv_kernel_size=4, gate_lower_bound=-5.0,
                                use_full_rank_gate=True),
    )
    return cfg


def test_tiny_layer_plan_matches_spec_section_8():
    cfg = parse_config(tiny())
    assert cfg.mla_layer_indices == (3, 7, 9)
    assert cfg.kda_layer_indices == (0, 1, 2, 4, 5, 6, 8)
    assert [p.ffn for p in cfg.layers] == ["dense"] + ["moe"] * 9
    assert [p.index for p in cfg.layers if p.block_write] == [0, 4, 8]
    assert cfg.num_attn_res_blocks == 3
    assert cfg.kda.proj_dim == 128 and cfg.mla.qk_head_dim == 48 and cfg.mla.latent_dim == 80


def test_k3_layer_plan_and_tensor_inventory_match_spec():
    cfg = parse_config(k3_text_config())
    assert len(cfg.mla_layer_indices) == 24 and len(cfg.kda_layer_indices) == 69
    assert cfg.mla_layer_indices[-2:] == (91, 92)
    assert [p.index for p in cfg.layers if p.block_write] == [0, 12, 24, 36, 48, 60, 72, 84]
    assert not any(p.block_write and p.attention == "mla" for p in cfg.layers)
    assert cfg.num_attn_res_blocks == 8
    # Spec §5.6: the text model of the released checkpoint has 497,052 tensors.
    assert len(expected_sources(cfg)) == 497_052


def test_nested_and_flat_forms_parse_to_the_same_model():
    flat = parse_config(preset_config("tiny"))
    nested = parse_config(preset_config("tiny-nested"))
    assert nested.nested and not flat.nested
    assert nested.layers == flat.layers and nested.mla == flat.mla and nested.kda == flat.kda


def test_mxfp4_quantization_detected():
    assert parse_config(preset_config("tiny-mxfp4")).moe.mxfp4
    assert not parse_config(preset_config("tiny")).moe.mxfp4


def _lac(**changes):
    lac = copy.deepcopy(TINY["linear_attn_config"])
    lac.update(changes)
    return lac


BROKEN = [
    ("model_type", dict(model_type="llama"), "field `model_type` = 'llama': expected 'kimi_k3' or 'kimi_linear'"),
    ("missing field", dict(hidden_size=None), "field `hidden_size` is missing: expected an integer >= 1"),
    ("wrong type", dict(vocab_size="1024"), "field `vocab_size` = '1024': expected an integer >= 1"),
    ("overlap", dict(linear_attn_config=_lac(kda_layers=[1, 2, 3, 4, 5, 6, 7, 9])),
     "field `linear_attn_config.kda_layers` = [1, 2, 3, 4, 5, 6, 7, 9]: expected layers disjoint from "
     "full_attn_layers (in both: [4])"),
    ("neither", dict(linear_attn_config=_lac(full_attn_layers=[4, 8])),
     "field `linear_attn_config.full_attn_layers` = [4, 8]: expected every layer in exactly one of kda_layers / "
     "full_attn_layers (in neither: [10])"),
    ("out of range", dict(linear_attn_config=_lac(full_attn_layers=[4, 8, 11])),
     "expected 1-based layer indices in [1, 10] (out of range: [11])"),
    ("zero-based", dict(linear_attn_config=_lac(kda_layers=[0, 1, 2, 4, 5, 6, 8])),
     "out of range: [0]"),
    ("lower bound too low", dict(linear_attn_config=_lac(gate_lower_bound=-6.0)),
     "field `linear_attn_config.gate_lower_bound` = -6.0: expected a value in [-5, 0)"),
    ("lower bound zero", dict(linear_attn_config=_lac(gate_lower_bound=0.0)),
     "field `linear_attn_config.gate_lower_bound` = 0.0: expected a value in [-5, 0)"),
    ("low-rank gate", dict(linear_attn_config=_lac(use_full_rank_gate=False)),
     "field `linear_attn_config.use_full_rank_gate` = False: expected true"),
    ("top-k", dict(num_experts_per_token=9), "field `num_experts_per_token` = 9: expected at most num_experts = 8"),
    ("topk_group", dict(num_expert_group=2, topk_group=3),
     "field `topk_group` = 3: expected at most num_expert_group = 2"),
    ("router func", dict(moe_router_activation_func="relu"),
     "field `moe_router_activation_func` = 'relu': expected one of 'sigmoid', 'softmax'"),
    ("k3 act", dict(hidden_act="silu"), "field `hidden_act` = 'silu': expected 'situ'"),
    ("k3 latent norm", dict(latent_moe_use_norm=False), "field `latent_moe_use_norm` = False: expected true"),
    ("k3 renormalize", dict(moe_renormalize=False), "field `moe_renormalize` = False: expected true"),
    ("unknown act", dict(hidden_act="gelu"), "field `hidden_act` = 'gelu': expected one of 'silu', 'situ'"),
    ("mxfp4 dims", dict(moe_intermediate_size=48, quantization_config=copy.deepcopy(MXFP4_QUANT)),
     "field `moe_intermediate_size` = 48: expected a multiple of 32"),
    ("quant scheme", dict(quantization_config={"config_groups": {"g": {"weights": {"num_bits": 8}}}}),
     "field `quantization_config.config_groups.g.weights` = {'num_bits': 8}: expected MXFP4"),
    ("situ beta", dict(activation_situ_beta=-1.0), "field `activation_situ_beta` = -1.0: expected a positive number"),
    ("rope pairs", dict(mla_use_nope=False, qk_rope_head_dim=15), "field `qk_rope_head_dim` = 15: expected an even"),
    ("conv width", dict(linear_attn_config=_lac(short_conv_kernel_size=1)),
     "field `linear_attn_config.short_conv_kernel_size` = 1: expected an integer >= 2"),
]


@pytest.mark.parametrize("what,changes,message", BROKEN, ids=[b[0] for b in BROKEN])
def test_broken_config_names_the_field(what, changes, message):
    data = tiny(**changes)
    with pytest.raises(ConfigError) as err:
        parse_config(data, source="x/config.json")
    assert message in str(err.value)
    assert str(err.value).startswith("x/config.json: ")


def test_nested_without_text_config():
    with pytest.raises(ConfigError, match="field `text_config` = None: expected an object"):
        parse_config({"model_type": "kimi_k3"})


def test_nested_k3_requires_latent_moe():
    data = preset_config("tiny-nested")
    del data["text_config"]["routed_expert_hidden_size"]
    with pytest.raises(ConfigError, match=r"field `text_config.routed_expert_hidden_size` = None: expected a positive"):
        parse_config(data)


def test_load_config_errors_name_the_file(tmp_path):
    with pytest.raises(ConfigError, match="not found"):
        load_config(tmp_path)
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(ConfigError, match="config.json: not valid JSON"):
        load_config(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps(tiny()))
    assert load_config(tmp_path).hidden_size == 128
