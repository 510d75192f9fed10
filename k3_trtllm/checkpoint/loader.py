"""Assemble model tensors from an HF checkpoint through the transformation table, with the
completeness check: every expected tensor present exactly once, unknown tensors reported,
shapes and dtypes checked against the config from the file headers — each kind of problem
reported in full in one error, before any tensor data is read."""
from __future__ import annotations

from typing import Iterator

import torch

from ..config import K3Config
from .hf import CheckpointError, HFCheckpoint
from .mapping import Part, Target, combine, targets

_SHOWN = 20  # names listed per problem kind; the count says how many there are


def _names(dtypes) -> str:
    return " or ".join(str(d).replace("torch.", "") for d in dtypes)


def part_problem(part: Part, shape: tuple[int, ...], dtype: torch.dtype) -> str | None:
    if shape != part.shape and shape not in part.alt_shapes:
        return f"has shape {list(shape)}, expected {list(part.shape)} from config.json"
    if dtype not in part.dtypes:
        return f"has dtype {_names([dtype])}, expected {_names(part.dtypes)}"
    return None


def expected_parts(cfg: K3Config) -> dict[str, Part]:
    seen: dict[str, Part] = {}
    for t in targets(cfg):
        for p in t.parts:
            seen.setdefault(p.source, p)
    return seen


def expected_sources(cfg: K3Config) -> list[str]:
    return list(expected_parts(cfg))


def _listing(what: str, items: list[str]) -> str:
    more = " ..." if len(items) > _SHOWN else ""
    return f"  {what} {len(items)} tensor(s): " + ", ".join(items[:_SHOWN]) + more


def check_inventory(ckpt: HFCheckpoint) -> None:
    """Report every missing and every unexpected tensor name at once."""
    expected = set(expected_sources(ckpt.config))
    present = ckpt.names()
    missing, unexpected = sorted(expected - present), sorted(present - expected)
    if missing or unexpected:
        lines = [f"{ckpt.path}: checkpoint does not match config.json"]
        if missing:
            lines.append(_listing("missing", missing))
        if unexpected:
            lines.append(_listing("unexpected", unexpected))
        raise CheckpointError("\n".join(lines))


def check_headers(ckpt: HFCheckpoint) -> None:
    """Every tensor's stored shape and dtype against the config (all mismatches at once)."""
    problems = []
    for name, part in expected_parts(ckpt.config).items():
        info = ckpt.info(name)
        problem = part_problem(part, info.shape, info.dtype)
        if problem:
            problems.append(f"  {info.file.name}: tensor {info.key!r} {problem}")
    if problems:
        more = ["  ..."] if len(problems) > _SHOWN else []
        raise CheckpointError("\n".join([f"{ckpt.path}: {len(problems)} tensor(s) do not match config.json",
                                         *problems[:_SHOWN], *more]))


def check_checkpoint(ckpt: HFCheckpoint) -> None:
    check_inventory(ckpt)
    check_headers(ckpt)


def iter_targets(ckpt: HFCheckpoint) -> Iterator[tuple[Target, torch.Tensor]]:
    """Yield ``(target, tensor)`` one target at a time (world size 1)."""
    check_checkpoint(ckpt)
    for target in targets(ckpt.config):
        parts = [ckpt.read(p.source, shape=p.shape) for p in target.parts]
        yield target, combine(target, parts, ckpt.config)


def load_hf_state_dict(path, cfg: K3Config | None = None) -> tuple[K3Config, dict[str, torch.Tensor]]:
    with HFCheckpoint(path, cfg) as ckpt:
        return ckpt.config, {t.name: x for t, x in iter_targets(ckpt)}
