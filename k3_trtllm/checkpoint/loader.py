"""Assemble model tensors from an HF checkpoint through the transformation table, with the
completeness check: every expected tensor consumed exactly once, unknown tensors reported,
shapes and dtypes checked against the config — all problems in one error."""
from __future__ import annotations

from typing import Callable, Iterator

import torch

from ..config import K3Config
from .hf import CheckpointError, HFCheckpoint
from .mapping import Part, Target, combine, targets


def check_part(part: Part, tensor: torch.Tensor, where: str) -> None:
    shape = tuple(tensor.shape)
    if shape != part.shape and shape not in part.alt_shapes:
        raise CheckpointError(
            f"{where}: tensor {part.source!r} has shape {list(shape)}, expected {list(part.shape)} from config.json"
        )
    if tensor.dtype not in part.dtypes:
        names = " or ".join(str(d).replace("torch.", "") for d in part.dtypes)
        raise CheckpointError(
            f"{where}: tensor {part.source!r} has dtype {str(tensor.dtype).replace('torch.', '')}, expected {names}"
        )


def expected_sources(cfg: K3Config) -> list[str]:
    seen: dict[str, None] = {}
    for t in targets(cfg):
        for p in t.parts:
            seen.setdefault(p.source)
    return list(seen)


def check_inventory(ckpt: HFCheckpoint) -> None:
    """Report every missing and every unexpected tensor name at once."""
    expected = set(expected_sources(ckpt.config))
    present = ckpt.names()
    missing, unexpected = sorted(expected - present), sorted(present - expected)
    if missing or unexpected:
        lines = [f"{ckpt.path}: checkpoint does not match config.json"]
        if missing:
            lines.append(f"  missing {len(missing)} tensor(s): " + ", ".join(missing[:20])
                         + (" ..." if len(missing) > 20 else ""))
        if unexpected:
            lines.append(f"  unexpected {len(unexpected)} tensor(s): " + ", ".join(unexpected[:20])
                         + (" ..." if len(unexpected) > 20 else ""))
        raise CheckpointError("\n".join(lines))


def iter_targets(
    ckpt: HFCheckpoint,
    shard: Callable[[Target, Part, torch.Tensor], torch.Tensor] | None = None,
) -> Iterator[tuple[Target, torch.Tensor]]:
    """Yield ``(target, tensor)`` one target at a time; ``shard`` (convert) turns each
    full HF part into its rank-local slice before combining."""
    check_inventory(ckpt)
    for target in targets(ckpt.config):
        parts = []
        for part in target.parts:
            tensor = ckpt.read(part.source)
            check_part(part, tensor, str(ckpt.index[part.source][0]))
            parts.append(shard(target, part, tensor) if shard else tensor)
        yield target, combine(target, parts, ckpt.config)


def load_hf_state_dict(path, cfg: K3Config | None = None) -> tuple[K3Config, dict[str, torch.Tensor]]:
    ckpt = HFCheckpoint(path, cfg)
    try:
        return ckpt.config, {t.name: x for t, x in iter_targets(ckpt)}
    finally:
        ckpt.close()
