"""What a directory handed to k3-trt as a checkpoint holds.

Every command that opens a checkpoint asks here first, so that a directory that is not
one (an engine dir from ``k3-trt build``, an empty dir, another model) is refused in one
line that says what was found and what to pass, instead of failing later on a missing
config field or tensor."""
from __future__ import annotations

import json
from pathlib import Path

from .errors import CheckpointError
from .trtllm import ARCHITECTURE

HF, TRTLLM = "hf", "trtllm"  # an HF K3 checkpoint; a checkpoint written by `k3-trt convert`
HF_MODEL_TYPES = ("kimi_k3", "kimi_linear")

_WANTED = ("pass a K3 checkpoint directory: an HF one (config.json with model_type 'kimi_k3' or "
           "'kimi_linear', and *.safetensors) or one written by `k3-trt convert`")
_LISTED = 5  # entries named when describing a directory that holds no config.json


def checkpoint_format(path: str | Path) -> str:
    """``HF`` or ``TRTLLM``; any other directory raises ``CheckpointError``."""
    p = Path(path)
    if not p.exists():
        raise CheckpointError(f"{p}: no such directory; {_WANTED}")
    if not p.is_dir():
        raise CheckpointError(f"{p}: is a file, not a directory; {_WANTED}")
    config = p / "config.json"
    if not config.is_file():
        raise CheckpointError(f"{p}: {_contents(p)}, no config.json; {_WANTED}")
    try:
        data = json.loads(config.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise CheckpointError(f"{config}: cannot read it as JSON ({e}); {_WANTED}") from e
    if not isinstance(data, dict):
        raise CheckpointError(f"{config}: not a JSON object; {_WANTED}")
    if data.get("architecture") == ARCHITECTURE:
        if "k3" in data:
            return TRTLLM
        if "ranks" in data and "limits" in data:
            built_from = data.get("checkpoint")
            source = f" ({built_from})" if isinstance(built_from, str) else ""
            raise CheckpointError(f"{p}: an engine directory written by `k3-trt build` (config.json has `ranks` "
                                  f"and `limits`), not a checkpoint; pass the checkpoint it was built from{source}")
        raise CheckpointError(f"{config}: architecture {ARCHITECTURE!r} but no `k3` field: not a complete "
                              f"checkpoint written by `k3-trt convert`; {_WANTED}")
    model_type = data.get("model_type")
    if model_type in HF_MODEL_TYPES:
        return HF
    found = f"model_type {model_type!r}" if model_type is not None else "no model_type"
    if data.get("architectures"):
        found += f", architectures {data['architectures']!r}"
    raise CheckpointError(f"{config}: {found}: not a Kimi K3 checkpoint; {_WANTED}")


def _contents(p: Path) -> str:
    entries = sorted(e.name for e in p.iterdir())
    if not entries:
        return "empty directory"
    shown = ", ".join(entries[:_LISTED]) + (", ..." if len(entries) > _LISTED else "")
    return f"holds {len(entries)} entr{'y' if len(entries) == 1 else 'ies'} ({shown})"
