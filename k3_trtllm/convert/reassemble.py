"""Rebuild the world-size-1 tensors from a sharded converted checkpoint: the inverse of
the converter's sharding, for verification (a sharded checkpoint must hold exactly the
world-1 tensors, split) and for running the world-1 reference model on it. Loads every
rank file; meant for checkpoints that fit in memory."""
from __future__ import annotations

import math
from pathlib import Path

import torch

from ..checkpoint.mapping import COLS, ROWS, Target, targets
from ..checkpoint.safetensors_format import element_size
from ..checkpoint.trtllm import load_trtllm_state_dict, read_trtllm_config
from ..config import K3Config
from ..checkpoint.rank_layout import RankLayout
from .errors import ConvertError
from .plan import Placed, Planner


def reassemble(path: str | Path) -> tuple[K3Config, dict[str, torch.Tensor]]:
    cfg, data = read_trtllm_config(path)
    par = RankLayout.from_mapping_json(data["mapping"], cfg, f"{Path(path) / 'config.json'}")
    ranks = [load_trtllm_state_dict(path, r)[1] for r in range(par.world_size)]
    sharded = Planner(cfg, par, [])
    whole = Planner(cfg, RankLayout(1, 1, par.num_experts), [])
    state = {}
    for target in targets(cfg):
        units = [_gather(target, unit[0].split, placed, ranks) for unit, placed in sharded.placed_units(target)]
        out = torch.cat(units, 0) if len(units) > 1 else units[0]
        state[target.name] = out.reshape(whole.target_entries(target)[0].shape)
    return cfg, state


def _gather(target: Target, split: str, placed: list[Placed], ranks: list[dict[str, torch.Tensor]]) -> torch.Tensor:
    """One unit's world-1 output from its slices on the ranks holding it."""
    pieces = []
    for p in sorted(placed, key=lambda p: p.holder.index):
        data = ranks[p.holder.rank][target.name].reshape(-1).view(torch.uint8)
        n = math.prod(p.shape) * element_size(target.dtype)
        pieces.append(data[p.offset: p.offset + n].view(target.dtype).view(p.shape))
    if placed[0].holder.count == 1:
        for p, piece in zip(placed[1:], pieces[1:]):
            if not torch.equal(piece, pieces[0]):
                raise ConvertError(f"{target.name}: replicated data differs between rank "
                                   f"{placed[0].holder.rank} and rank {p.holder.rank}")
        return pieces[0]
    if split not in (ROWS, COLS):
        raise ConvertError(f"{target.name}: split {split!r} over {placed[0].holder.count} ranks")
    return torch.cat(pieces, 0 if split == ROWS else 1)
