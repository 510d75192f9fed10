"""The TensorRT-LLM-format checkpoint that ``k3-trt convert`` writes: ``config.json``
(architecture ``KimiK3ForCausalLM``, TRT-LLM's common fields, ``mapping``,
``quantization``, the flat K3 text config under ``k3``, the layer plan and a per-rank
manifest) and one ``rank{N}.safetensors`` per rank. Both directions live here so that
the writer and the reader cannot drift apart."""
from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

import torch

from ..config import ConfigError, K3Config, parse_config
from .errors import CheckpointError
from .safetensors_format import SafetensorsFormatError, load_tensors, read_header

ARCHITECTURE = "KimiK3ForCausalLM"
MXFP4_QUANT_ALGO = "W4A16_MXFP4"  # TRT-LLM QuantAlgo: MXFP4 weights, 16-bit activations


def rank_file(path: str | Path, rank: int) -> Path:
    return Path(path) / f"rank{rank}.safetensors"


def k3_text_config(cfg: K3Config, source: dict[str, Any], mxfp4_experts: bool) -> dict[str, Any]:
    """The flat ``kimi_linear`` config of the converted model: the source's text config,
    with ``quantization_config`` kept only when the experts stay MXFP4."""
    k3 = cfg.text_dict()
    k3["model_type"] = "kimi_linear"
    quant = k3.pop("quantization_config", None) or source.get("quantization_config")
    if mxfp4_experts:
        k3["quantization_config"] = quant
    if "pad_token_id" not in k3 and source.get("pad_token_id") is not None:
        k3["pad_token_id"] = source["pad_token_id"]
    return k3


def trtllm_config(cfg: K3Config, k3: dict[str, Any], mapping: dict[str, Any], mxfp4_experts: bool,
                  manifest: dict[str, dict[str, int]]) -> dict[str, Any]:
    heads = cfg.mla.num_heads if cfg.mla is not None else cfg.kda.num_heads
    common = {
        "vocab_size": cfg.vocab_size, "hidden_size": cfg.hidden_size, "num_hidden_layers": cfg.num_hidden_layers,
        "num_attention_heads": heads, "num_key_value_heads": heads, "intermediate_size": cfg.intermediate_size,
        "hidden_act": cfg.hidden_act, "norm_epsilon": cfg.rms_norm_eps,
        "max_position_embeddings": k3.get("max_position_embeddings"),
    }
    quantization: dict[str, Any] = {"quant_algo": MXFP4_QUANT_ALGO if mxfp4_experts else None,
                                    "kv_cache_quant_algo": None}
    if mxfp4_experts:
        quantization["group_size"] = 32
    return {"architecture": ARCHITECTURE, "dtype": "bfloat16", **common, "mapping": mapping,
            "quantization": quantization, "k3": k3,
            "layer_plan": [dataclasses.asdict(p) for p in cfg.layers], "manifest": manifest}


def is_trtllm_checkpoint(path: str | Path) -> bool:
    cfg = Path(path) / "config.json"
    if not cfg.exists():
        return False
    try:
        return json.loads(cfg.read_text()).get("architecture") == ARCHITECTURE
    except (json.JSONDecodeError, AttributeError):
        return False


def read_trtllm_config(path: str | Path) -> tuple[K3Config, dict[str, Any]]:
    p = Path(path) / "config.json"
    try:
        data = json.loads(p.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise ConfigError(f"{p}: cannot read ({e})") from e
    if not isinstance(data, dict) or data.get("architecture") != ARCHITECTURE:
        raise ConfigError(f"{p}: field `architecture` is not {ARCHITECTURE!r} (not written by k3-trt convert)")
    if not isinstance(data.get("k3"), dict):
        raise ConfigError(f"{p}: field `k3` missing: expected the K3 text config written by k3-trt convert")
    for key in ("mapping", "quantization", "manifest"):
        if not isinstance(data.get(key), dict):
            raise ConfigError(f"{p}: field `{key}` missing: expected an object")
    cfg = parse_config(data["k3"], source=f"{p} (field k3)")
    mxfp4 = cfg.moe is not None and cfg.moe.mxfp4
    algo = data["quantization"].get("quant_algo")
    if algo != (MXFP4_QUANT_ALGO if mxfp4 else None):
        raise ConfigError(f"{p}: field `quantization.quant_algo` = {algo!r} disagrees with `k3` "
                          f"({'MXFP4' if mxfp4 else 'bf16'} routed experts)")
    return cfg, data


def load_trtllm_state_dict(path: str | Path, rank: int = 0) -> tuple[K3Config, dict[str, torch.Tensor], dict]:
    """One rank's tensors, after checking the file against the manifest."""
    cfg, data = read_trtllm_config(path)
    f = rank_file(path, rank)
    if not f.exists():
        raise CheckpointError(f"{f}: not found (config.json maps world size {data['mapping'].get('world_size')})")
    expected = data["manifest"].get(f"rank{rank}", {})
    try:
        header = read_header(f)
    except SafetensorsFormatError as e:
        raise CheckpointError(str(e)) from e
    found = {"tensors": len(header), "file_bytes": f.stat().st_size}
    if any(expected.get(k) != v for k, v in found.items()):
        raise CheckpointError(f"{f}: holds {found['tensors']} tensors in {found['file_bytes']} bytes, the "
                              f"config.json manifest records {expected.get('tensors')} in {expected.get('file_bytes')}")
    try:
        return cfg, load_tensors(f), data
    except SafetensorsFormatError as e:
        raise CheckpointError(str(e)) from e
