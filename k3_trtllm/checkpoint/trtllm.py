"""The TensorRT-LLM-format checkpoint that ``k3-trt convert`` writes: ``config.json``
(architecture ``KimiK3ForCausalLM``, ``mapping``, ``quantization``, the K3 text config
under ``k3``) and one ``rank{N}.safetensors`` per rank."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file

from ..config import ConfigError, K3Config, parse_config
from .hf import CheckpointError

ARCHITECTURE = "KimiK3ForCausalLM"


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
    data = json.loads(p.read_text())
    if not isinstance(data.get("k3"), dict):
        raise ConfigError(f"{p}: field `k3` missing: expected the K3 text config written by k3-trt convert")
    return parse_config(data["k3"], source=f"{p} (field k3)"), data


def load_trtllm_state_dict(path: str | Path, rank: int = 0) -> tuple[K3Config, dict[str, torch.Tensor], dict]:
    cfg, data = read_trtllm_config(path)
    f = Path(path) / f"rank{rank}.safetensors"
    if not f.exists():
        raise CheckpointError(f"{f}: not found (config.json maps world size {data['mapping']['world_size']})")
    return cfg, load_file(str(f)), data
