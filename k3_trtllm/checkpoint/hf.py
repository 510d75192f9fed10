"""Read an HF K3 checkpoint directory one tensor at a time.

Names are canonicalised to the flat ``kimi_linear`` form (``model.…``, ``lm_head.weight``)
whatever prefix the files use (spec §5.1); vision, projector, rotary-cache and MTP tensors
are skipped. Nothing is loaded until asked for, so a multi-terabyte checkpoint costs only
its headers here.
"""
from __future__ import annotations

import json
import re
from pathlib import Path

import torch
from safetensors import safe_open

from ..config import K3Config, load_config


class CheckpointError(ValueError):
    """A checkpoint that cannot be read or does not match its config; names the file/tensor."""


_SKIP_PREFIXES = ("vision_tower.", "mm_projector.")
_LAYER = re.compile(r"^model\.layers\.(\d+)\.")


def canonical_name(name: str) -> str:
    """``language_model.model.X`` / ``language_model.layers.i.X`` / ``model.language_model.X``
    → ``model.X``; ``language_model.lm_head.weight`` → ``lm_head.weight``."""
    for prefix in ("model.language_model.", "language_model."):
        if name.startswith(prefix):
            rest = name[len(prefix):]
            if rest.startswith(("model.", "lm_head.")):
                return rest
            return "model." + rest
    return name


class HFCheckpoint:
    def __init__(self, path: str | Path, config: K3Config | None = None):
        self.path = Path(path)
        if not self.path.is_dir():
            raise CheckpointError(f"{self.path}: not a directory (expected an HF K3 checkpoint directory)")
        self.config = config or load_config(self.path)
        self._handles: dict[Path, object] = {}
        self.files, self.index = self._discover()

    def _discover(self) -> tuple[list[Path], dict[str, tuple[Path, str]]]:
        index_file = self.path / "model.safetensors.index.json"
        if index_file.exists():
            try:
                weight_map = json.loads(index_file.read_text())["weight_map"]
            except (json.JSONDecodeError, KeyError, TypeError) as e:
                raise CheckpointError(f"{index_file}: expected JSON with a `weight_map` object ({e})") from e
            files = sorted({self.path / f for f in weight_map.values()})
            missing = [f.name for f in files if not f.exists()]
            if missing:
                raise CheckpointError(f"{index_file}: names shard(s) that do not exist: {', '.join(missing)}")
        else:
            files = sorted(self.path.glob("*.safetensors"))
            if not files:
                raise CheckpointError(f"{self.path}: no *.safetensors files and no model.safetensors.index.json")
        index: dict[str, tuple[Path, str]] = {}
        num_layers = self.config.num_hidden_layers
        for f in files:
            for raw in self._keys(f):
                if raw.startswith(_SKIP_PREFIXES) or "rotary_emb." in raw:
                    continue
                name = canonical_name(raw)
                m = _LAYER.match(name)
                if m and int(m.group(1)) >= num_layers and self._is_mtp(int(m.group(1))):
                    continue
                if name in index:
                    raise CheckpointError(
                        f"{f.name}: tensor {raw!r} duplicates {index[name][1]!r} in {index[name][0].name}"
                    )
                index[name] = (f, raw)
        return files, index

    def _is_mtp(self, layer: int) -> bool:
        n = int(self.config.raw.get("num_nextn_predict_layers") or 0)
        return layer < self.config.num_hidden_layers + n

    def _open(self, f: Path):
        if f not in self._handles:
            try:
                self._handles[f] = safe_open(str(f), framework="pt")
            except Exception as e:  # safetensors raises its own error types for bad headers
                raise CheckpointError(f"{f}: not a readable safetensors file ({e})") from e
        return self._handles[f]

    def _keys(self, f: Path) -> list[str]:
        return list(self._open(f).keys())

    def names(self) -> set[str]:
        return set(self.index)

    def nbytes(self, name: str) -> int:
        f, raw = self.index[name]
        sl = self._open(f).get_slice(raw)
        return _numel(sl.get_shape()) * _dtype_size(sl.get_dtype())

    def read(self, name: str) -> torch.Tensor:
        f, raw = self.index[name]
        try:
            return self._open(f).get_tensor(raw)
        except Exception as e:
            raise CheckpointError(f"{f}: cannot read tensor {raw!r} ({e}); the file may be truncated") from e

    def close(self) -> None:
        self._handles.clear()


def _numel(shape) -> int:
    n = 1
    for s in shape:
        n *= s
    return n


_SIZES = {"BF16": 2, "F16": 2, "F32": 4, "F64": 8, "U8": 1, "I8": 1, "I32": 4, "I64": 8, "BOOL": 1,
          "F8_E4M3": 1, "F8_E5M2": 1, "F8_E8M0": 1}


def _dtype_size(dtype: str) -> int:
    return _SIZES.get(dtype, 4)
