"""What marks a segmented engine dir (``trt/segment_build.py``), importable without the
ONNX tooling, so that ``k3-trt run`` can tell an engine dir from a checkpoint cheaply."""
from __future__ import annotations

import json
from pathlib import Path

from ..checkpoint.trtllm import ARCHITECTURE

LAYOUT = "segments"  # config.json "layout"
CONFIG_VERSION = 2


def is_segmented_engine_dir(path: str | Path) -> bool:
    p = Path(path) / "config.json"
    try:
        data = json.loads(p.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError):
        return False
    return isinstance(data, dict) and data.get("layout") == LAYOUT and data.get("architecture") == ARCHITECTURE


def engine_limits(path: str | Path) -> dict:
    """The step limits (max_batch_size, max_num_tokens, max_seq_len, block_size, ...) a
    segmented engine dir was built for; an unreadable or malformed config reads as {}, which
    the engine's own loader then reports."""
    try:
        limits = json.loads((Path(path) / "config.json").read_text()).get("limits")
    except (OSError, UnicodeDecodeError, json.JSONDecodeError, AttributeError):
        return {}
    return limits if isinstance(limits, dict) else {}
