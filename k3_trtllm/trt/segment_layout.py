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
