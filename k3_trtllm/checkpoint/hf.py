"""Read an HF K3 checkpoint directory one tensor (or row range) at a time.

Names are canonicalised to the flat ``kimi_linear`` form (``model.…``, ``lm_head.weight``)
whatever prefix the files use (spec §5.1); vision, projector, rotary-cache and MTP tensors
are skipped. Opening a checkpoint parses and validates every shard's header (a truncated
shard fails here, before any data is read); data is read with ``pread`` into fresh
tensors, so memory holds only what the caller keeps and threads may read concurrently.
"""
from __future__ import annotations

import json
import os
import re
import threading
from pathlib import Path, PurePosixPath

import torch

from ..config import K3Config, load_config
from .detect import TRTLLM, checkpoint_format
from .errors import CheckpointError
from .safetensors_format import SafetensorsFormatError, TensorInfo, read_header, read_tensor, row_span

__all__ = ["CheckpointError", "HFCheckpoint", "canonical_name"]

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
        if config is None and checkpoint_format(self.path) == TRTLLM:
            raise CheckpointError(f"{self.path}: a checkpoint written by `k3-trt convert`; this step reads an HF "
                                  "K3 checkpoint: pass the directory it was converted from")
        if not self.path.is_dir():
            raise CheckpointError(f"{self.path}: not a directory (expected an HF K3 checkpoint directory)")
        self.config = config or load_config(self.path)
        self._fds: dict[Path, int] = {}
        self._lock = threading.Lock()
        self.files, self.index = self._discover()

    def _discover(self) -> tuple[list[Path], dict[str, TensorInfo]]:
        index_file = self.path / "model.safetensors.index.json"
        if index_file.exists():
            try:
                weight_map = json.loads(index_file.read_text())["weight_map"]
                shard_names = set(weight_map.values())
            except (json.JSONDecodeError, KeyError, TypeError, AttributeError) as e:
                raise CheckpointError(f"{index_file}: expected JSON with a `weight_map` object ({e})") from e
            files = sorted({self._shard(index_file, name) for name in shard_names})
            missing = [str(f.relative_to(self.path)) for f in files if not f.exists()]
            if missing:
                raise CheckpointError(f"{index_file}: names shard(s) that do not exist: {', '.join(missing)}")
        else:
            files = sorted(self.path.glob("*.safetensors"))
            if not files:
                raise CheckpointError(f"{self.path}: no *.safetensors files and no model.safetensors.index.json")
            for f in files:
                self._check_inside(f, f"{f}: a symbolic link")
        index: dict[str, TensorInfo] = {}
        num_layers = self.config.num_hidden_layers
        for f in files:
            try:
                header = read_header(f)
            except SafetensorsFormatError as e:
                raise CheckpointError(str(e)) from e
            except OSError as e:
                raise CheckpointError(f"{f}: cannot read ({e.strerror or e})") from e
            for raw, info in header.items():
                if raw.startswith(_SKIP_PREFIXES) or "rotary_emb." in raw:
                    continue
                name = canonical_name(raw)
                m = _LAYER.match(name)
                if m and int(m.group(1)) >= num_layers and self._is_mtp(int(m.group(1))):
                    continue
                if name in index:
                    raise CheckpointError(
                        f"{f.name}: tensor {raw!r} duplicates {index[name].key!r} in {index[name].file.name}")
                index[name] = info
        return files, index

    def _shard(self, index_file: Path, name) -> Path:
        """The index's shard ``name`` as a path, refused unless it lies inside the checkpoint
        directory: the index is untrusted input, and must not make k3-trt open other files."""
        if not isinstance(name, str) or not name or "\0" in name:
            raise CheckpointError(f"{index_file}: shard name {name!r} is not a file name")
        rel = PurePosixPath(name)
        if rel.is_absolute() or ".." in rel.parts:
            raise CheckpointError(f"{index_file}: shard {name!r} lies outside {self.path} (shard names are paths "
                                  "relative to the checkpoint directory, without '..')")
        f = self.path / rel
        self._check_inside(f, f"{index_file}: shard {name!r}")
        return f

    def _check_inside(self, f: Path, what: str) -> None:
        """Refuse ``f`` if it is (or passes through) a symbolic link to outside the checkpoint.
        The Hugging Face hub cache is the one known layout that links out: a snapshot
        directory ``.../snapshots/<revision>/`` links each file to ``.../blobs/<hash>``."""
        real = f.resolve()
        base = self.path.resolve()
        roots = [base]
        if base.parent.name == "snapshots":
            roots.append(base.parent.parent / "blobs")
        if not any(real.is_relative_to(root) for root in roots):
            raise CheckpointError(f"{what} resolves to {real}, outside the checkpoint directory {base}")

    def _is_mtp(self, layer: int) -> bool:
        n = int(self.config.raw.get("num_nextn_predict_layers") or 0)
        return layer < self.config.num_hidden_layers + n

    def names(self) -> set[str]:
        return set(self.index)

    def info(self, name: str) -> TensorInfo:
        return self.index[name]

    def read(self, name: str, shape: tuple[int, ...] | None = None,
             rows: tuple[int, int] | None = None) -> torch.Tensor:
        """The tensor ``name`` viewed as ``shape`` (default: as stored; same element count),
        or only its rows ``[start, stop)`` along the first dimension of that shape."""
        info = self.index[name]
        start, stop = rows or (0, None)
        try:
            return read_tensor(self._fd(info.file), info, start, stop, shape)
        except SafetensorsFormatError as e:
            raise CheckpointError(f"{e} (truncated while reading?)") from e

    def span(self, name: str, shape: tuple[int, ...] | None = None,
             rows: tuple[int, int] | None = None) -> tuple[int, int, int]:
        """``(fd, offset, nbytes)`` of the bytes ``read`` would return, for copying them file to file."""
        info = self.index[name]
        start, stop = rows or (0, None)
        return (self._fd(info.file), *row_span(info, shape, start, stop))

    def _fd(self, f: Path) -> int:
        with self._lock:
            if f not in self._fds:
                self._fds[f] = os.open(f, os.O_RDONLY)
            return self._fds[f]

    def close(self) -> None:
        with self._lock:
            for fd in self._fds.values():
                os.close(fd)
            self._fds.clear()

    def __enter__(self) -> "HFCheckpoint":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
