"""Random K3 checkpoints in the exact HF layout (spec §5), for tests and examples.

Tensor names, shapes and dtypes come from the transformation table's HF side, so synth,
loader and converter cannot drift apart; the spec's own inventory is checked separately
in the tests (tensor counts of §5.6). Initialisation keeps activations O(1) through every
layer (unit-variance projections, norms near 1, small AttnRes queries) and logits with a
standard deviation of a few units, so that equality tests between code paths are
sensitive rather than comparing near-constant outputs."""
from __future__ import annotations

import copy
import json
import math
from pathlib import Path

import torch
from safetensors.torch import save

from ..config import K3Config, parse_config
from ..mxfp4 import quantize_mxfp4
from ..utils.atomic import atomic_output_dir, write_file
from .loader import expected_sources
from .mapping import targets

TINY = {
    "model_type": "kimi_linear", "architectures": ["KimiLinearForCausalLM"],
    "vocab_size": 1024, "hidden_size": 128, "intermediate_size": 384, "num_hidden_layers": 10,
    "num_attention_heads": 4, "num_key_value_heads": 4, "hidden_act": "situ",
    "activation_situ_beta": 4.0, "activation_situ_linear_beta": 25.0, "rms_norm_eps": 1e-05,
    "tie_word_embeddings": False, "pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2,
    "max_position_embeddings": 4096, "q_lora_rank": 64, "kv_lora_rank": 64, "qk_nope_head_dim": 32,
    "qk_rope_head_dim": 16, "v_head_dim": 32, "mla_use_nope": True, "mla_use_output_gate": True,
    "num_experts": 8, "num_experts_per_token": 3, "num_shared_experts": 2, "moe_intermediate_size": 64,
    "routed_expert_hidden_size": 64, "latent_moe_use_norm": True, "moe_router_activation_func": "sigmoid",
    "moe_renormalize": True, "routed_scaling_factor": 1.0, "use_grouped_topk": True, "num_expert_group": 1,
    "topk_group": 1, "topk_method": "noaux_tc", "first_k_dense_replace": 1, "moe_layer_freq": 1,
    "attn_res_block_size": 4, "num_nextn_predict_layers": 0,
    "linear_attn_config": {
        "kda_layers": [1, 2, 3, 5, 6, 7, 9], "full_attn_layers": [4, 8, 10], "num_heads": 4, "head_dim": 32,
        "short_conv_kernel_size": 4, "gate_lower_bound": -5.0, "use_full_rank_gate": True,
    },
}

MXFP4_QUANT = {
    "quant_method": "compressed-tensors", "format": "mxfp4-pack-quantized",
    "config_groups": {"group_0": {
        "targets": ["re:.*block_sparse_moe\\.experts\\..*\\.w[123]$"],
        "weights": {"num_bits": 4, "type": "float", "strategy": "group", "group_size": 32, "symmetric": True,
                    "dynamic": False},
        "input_activations": None,
    }},
    "ignore": ["lm_head"],
}

TINY_VISION = {"model_type": "moonvit", "hidden_size": 32, "num_hidden_layers": 1, "patch_size": 14}


def preset_config(name: str) -> dict:
    text = copy.deepcopy(TINY)
    if name == "tiny":
        return text
    if name == "tiny-mxfp4":
        text["quantization_config"] = copy.deepcopy(MXFP4_QUANT)
        return text
    if name == "tiny-nested":
        text["model_type"], text["architectures"] = "kimi_linear", ["KimiLinearForCausalLM"]
        return {"model_type": "kimi_k3", "architectures": ["KimiK3ForConditionalGeneration"],
                "text_config": text, "vision_config": copy.deepcopy(TINY_VISION),
                "media_placeholder_token_id": 1000, "pad_token_id": 0}
    if name == "kernel-shapes":
        text["linear_attn_config"].update(num_heads=2, head_dim=128)
        text.update(kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128,
                    num_attention_heads=2, q_lora_rank=256)
        return text
    raise ValueError(f"unknown preset {name!r}; expected one of {', '.join(PRESETS)}")


PRESETS = ("tiny", "tiny-mxfp4", "tiny-nested", "kernel-shapes")


def _init(name: str, shape: tuple[int, ...], dtype: torch.dtype, gen: torch.Generator) -> torch.Tensor:
    def normal(std: float) -> torch.Tensor:
        return torch.randn(shape, generator=gen) * std

    if name.endswith("embed_tokens.weight"):
        t = normal(1.0)
    elif name == "lm_head.weight":
        t = normal(2.5 / math.sqrt(shape[1]))
    elif name.endswith("_res_proj.weight"):
        t = normal(1.0 / math.sqrt(shape[-1]))  # AttnRes logits of O(1): sharp but not one-hot mixtures
    elif "norm.weight" in name:
        t = 1.0 + normal(0.1)
    elif name.endswith("conv1d.weight"):
        t = normal(0.5)
    elif name.endswith("A_log"):
        t = torch.log(torch.empty(shape).uniform_(1.0, 16.0, generator=gen))
    elif name.endswith("dt_bias"):
        t = normal(1.0)
    elif name.endswith("e_score_correction_bias"):
        t = normal(0.1)  # comparable to the spread of sigmoid scores, so it changes selections
    else:  # [out, in] projection: unit-variance outputs for unit-variance inputs
        t = normal(1.0 / math.sqrt(shape[-1]))
    return t.to(dtype)


def synth_tensors(cfg: K3Config, seed: int = 0) -> dict[str, torch.Tensor]:
    """HF-named tensors (flat names) for ``cfg``."""
    gen = torch.Generator().manual_seed(seed)
    parts = {p.source: p for t in targets(cfg) for p in t.parts}
    out: dict[str, torch.Tensor] = {}
    for name in expected_sources(cfg):
        part = parts[name]
        if name.endswith(".weight_packed") or name.endswith(".weight_scale"):
            continue  # produced with their bf16 originals below
        out[name] = _init(name, part.shape, part.dtypes[0], gen)  # the dtype real checkpoints hold
    if cfg.moe is not None and cfg.moe.mxfp4:
        inter, lat = cfg.moe.moe_intermediate_size, cfg.moe.latent_size or cfg.hidden_size
        for name, part in parts.items():
            if name.endswith(".weight_packed"):
                base = name[: -len(".weight_packed")]
                in_dim = lat if base.endswith(("w1", "w3")) else inter
                w = torch.randn(part.shape[0], in_dim, generator=gen) / math.sqrt(in_dim)
                out[name], out[base + ".weight_scale"] = quantize_mxfp4(w, name=base)
    return out


def write_checkpoint(out_dir: str | Path, config: dict, tensors: dict[str, torch.Tensor],
                     max_shard_bytes: int = 2 << 20, force: bool = False) -> Path:
    """Write ``config.json`` + safetensors shards + index atomically (temp dir, rename),
    marked as k3-trt's (``utils.atomic``)."""
    out = Path(out_dir)
    with atomic_output_dir(out, "hf-checkpoint", force=force) as tmp:
        shards: list[dict[str, torch.Tensor]] = [{}]
        size = 0
        for name, t in tensors.items():
            nbytes = t.numel() * t.element_size()
            if shards[-1] and size + nbytes > max_shard_bytes:
                shards.append({})
                size = 0
            shards[-1][name] = t.contiguous()
            size += nbytes
        weight_map = {}
        for i, shard in enumerate(shards):
            fname = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
            write_file(tmp / fname, save(shard, metadata={"format": "pt"}))
            weight_map.update({k: fname for k in shard})
        total = sum(t.numel() * t.element_size() for t in tensors.values())
        write_file(tmp / "model.safetensors.index.json",
                   json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=1))
        write_file(tmp / "config.json", json.dumps(config, indent=2))
    return out


def synth_checkpoint(out_dir: str | Path, preset: str = "tiny", seed: int = 0, force: bool = False) -> Path:
    config = preset_config(preset)
    cfg = parse_config(config, source=f"preset {preset}")
    tensors = synth_tensors(cfg, seed)
    if cfg.nested:
        # Nested checkpoints prefix text tensors (spec §5.1) and carry vision tensors the
        # text model must skip.
        tensors = {"language_model." + k: v for k, v in tensors.items()}
        gen = torch.Generator().manual_seed(seed + 1)
        tensors["vision_tower.patch_embed.proj.weight"] = torch.randn(32, 3, 14, 14, generator=gen).bfloat16()
        tensors["mm_projector.proj.0.weight"] = torch.randn(128, 32, generator=gen).bfloat16()
    return write_checkpoint(out_dir, config, tensors, force=force)
