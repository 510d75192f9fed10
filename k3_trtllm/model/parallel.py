"""Tensor and expert parallelism of the reference model (DESIGN §5), with TensorRT-LLM's
mapping as ``k3-trt convert`` writes it: world size = tp; heads, dense and shared MLP
intermediates and the vocabulary are split over the tp ranks; routed experts are split
contiguously over ``moe_ep`` ranks and each expert's intermediate over ``moe_tp = tp / moe_ep``
ranks. Every row-parallel product ends in one all-reduce (SUM) over the default
torch.distributed process group; at tp size 1 no collective is ever called."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch.nn.functional import embedding

from ..config import K3Config
from ..checkpoint.rank_layout import RankLayout


@dataclass(frozen=True)
class Parallel:
    """Where this rank sits; the default is world size 1."""

    tp_size: int = 1
    tp_rank: int = 0
    moe_ep_size: int = 1
    moe_ep_rank: int = 0
    moe_tp_size: int = 1
    moe_tp_rank: int = 0

    @classmethod
    def from_mapping(cls, mapping: dict[str, Any], cfg: K3Config, rank: int, where: str) -> "Parallel":
        """Rank ``rank`` of a converted checkpoint's ``mapping`` (the converter's own rank rules)."""
        return cls.from_layout(RankLayout.from_mapping_json(mapping, cfg, where), rank)

    @classmethod
    def from_layout(cls, layout: RankLayout, rank: int) -> "Parallel":
        return cls(layout.tp, rank, layout.ep, layout.moe_ep_rank(rank), layout.moe_tp, layout.moe_tp_rank(rank))

    def tp_local(self, n: int) -> int:
        """This rank's share of a tp-split dimension (the converter checked divisibility)."""
        return n // self.tp_size


def all_reduce(x: torch.Tensor, par: Parallel) -> torch.Tensor:
    """The sum of ``x`` over the tp ranks, where a row-parallel product ends. ``x`` must be a
    fresh result (it is reduced in place); returned unchanged at tp size 1."""
    if par.tp_size == 1:
        return x
    x = x.contiguous()
    dist.all_reduce(x)
    return x


def gather_columns(x: torch.Tensor, par: Parallel) -> torch.Tensor:
    """[T, N/tp] on every rank -> [T, N], rank 0's columns first (vocab-split LM head)."""
    if par.tp_size == 1:
        return x
    x = x.contiguous()
    parts = [torch.empty_like(x) for _ in range(par.tp_size)]
    dist.all_gather(parts, x)
    return torch.cat(parts, -1)


def embed(ids: torch.Tensor, weight: torch.Tensor, par: Parallel) -> torch.Tensor:
    """Vocab-split embedding: each rank looks up the ids among its rows, zeros elsewhere,
    and the all-reduce adds exactly one non-zero row per token."""
    if par.tp_size == 1:
        return embedding(ids, weight)
    rows = weight.shape[0]
    local = ids - par.tp_rank * rows
    outside = (local < 0) | (local >= rows)
    x = embedding(local.masked_fill(outside, 0), weight).masked_fill(outside[:, None], 0)
    return all_reduce(x, par)
