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


def _engine_config(path: str | Path) -> dict:
    """config.json of an engine dir; an unreadable or malformed one reads as {}, which the
    engine's own loader then reports."""
    try:
        config = json.loads((Path(path) / "config.json").read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError):
        return {}
    return config if isinstance(config, dict) else {}


def engine_limits(path: str | Path) -> dict:
    """The step limits (max_batch_size, max_num_tokens, max_seq_len, block_size, ...) a
    segmented engine dir was built for ({} when unreadable, see ``_engine_config``)."""
    limits = _engine_config(path).get("limits")
    return limits if isinstance(limits, dict) else {}


def engine_writes_snapshots(config: dict) -> bool:
    """Whether the engine's KDA segment takes the prefix cache's snapshot points and pools (its
    plugin then writes the snapshots mid-prefill). Engine dirs built before it did (no
    ``snapshot_offsets`` input) run with the snapshots copied where chunks end instead; an
    engine without KDA layers has nothing to snapshot."""
    kda = [s for s in config.get("segments", []) if isinstance(s, dict) and s.get("kind") == "kda_attention"]
    return all(any(isinstance(t, dict) and t.get("name") == "snapshot_offsets" for t in s.get("inputs", []))
               for s in kda)


def engine_dir_writes_snapshots(path: str | Path) -> bool:
    """``engine_writes_snapshots`` for the engine dir at ``path`` (an unreadable config: False,
    the engine's loader reports it)."""
    config = _engine_config(path)
    return bool(config) and engine_writes_snapshots(config)


def engine_kv_cache_dtype(config: dict) -> str | None:
    """What an engine's latent rows hold: "fp8" or its activation dtype's name (engine dirs
    from before the fp8 cache have no ``kv_cache_dtype`` field: theirs is the dtype)."""
    return config.get("kv_cache_dtype", config.get("dtype"))


def kv_cache_conflict(config: dict, given: str | None) -> str | None:
    """Why ``--kv-cache-dtype given`` (None: not given) cannot run the engine of ``config``
    (the rows are fixed at build), or None when it means the engine's own rows."""
    if given is None:
        return None
    built = engine_kv_cache_dtype(config)
    if {"auto": config.get("dtype"), "bf16": "bfloat16"}.get(given, given) == built:
        return None
    return (f"--kv-cache-dtype {given}: the engine is built with a{'n' if built == 'fp8' else ''} {built} latent "
            f"cache (leave the flag out, or rebuild with `k3-trt build --kv-cache-dtype {given}`)")


def engine_dir_kv_cache_conflict(path: str | Path, given: str | None) -> str | None:
    """``kv_cache_conflict`` for the engine dir at ``path`` (None when its config is unreadable:
    the engine's loader reports that)."""
    config = _engine_config(path)
    return kv_cache_conflict(config, given) if config else None
