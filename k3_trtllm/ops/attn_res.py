"""AttnRes (block attention residuals, spec §4.7): the mixing operator and the two
equivalent ways of running it over a block — the original per-sub-layer softmax and the
two-phase online-softmax form whose block statistics are computed once per block."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from .common import compute_dtype


def source_logits(v: torch.Tensor, query: torch.Tensor, eps: float) -> torch.Tensor:
    """l = (v · q_eff) · rsqrt(mean(v²) + eps), per token, fp32. v [T, d], query [d] -> [T]."""
    cd = compute_dtype(v.dtype)
    v32 = v.to(cd)
    return (v32 @ query.to(cd)) * torch.rsqrt(v32.pow(2).mean(-1) + eps)


def mix(sources: list[torch.Tensor], query: torch.Tensor, eps: float) -> torch.Tensor:
    """Softmax-weighted mixture of ``sources`` (valid blocks first, the partial sum last),
    computed and returned in fp32 (fp64 for fp64 sources)."""
    cd = compute_dtype(sources[0].dtype)
    logits = torch.stack([source_logits(v, query, eps) for v in sources], 0)  # [n, T]
    weights = torch.softmax(logits, 0)
    return sum(w.unsqueeze(-1) * v.to(cd) for w, v in zip(weights, sources))


@dataclass
class BlockStats:
    """Phase-1 statistics of one query over the block snapshots: running max, normaliser
    and un-normalised weighted sum (online softmax state)."""

    max: torch.Tensor  # [T]
    norm: torch.Tensor  # [T]
    acc: torch.Tensor  # [T, d]


def phase1(blocks: list[torch.Tensor], query: torch.Tensor, eps: float) -> BlockStats:
    cd = compute_dtype(blocks[0].dtype)
    logits = torch.stack([source_logits(b, query, eps) for b in blocks], 0)
    m = logits.max(0).values
    e = torch.exp(logits - m)
    acc = sum(w.unsqueeze(-1) * b.to(cd) for w, b in zip(e, blocks))
    return BlockStats(m, e.sum(0), acc)


def phase2(stats: BlockStats, partial: torch.Tensor | None, query: torch.Tensor, eps: float) -> torch.Tensor:
    """Merge the partial sum into precomputed block statistics; ``partial=None`` (the
    first attention input of a block, where P = 0 is not a source) uses the blocks only."""
    if partial is None:
        return stats.acc / stats.norm.unsqueeze(-1)
    cd = stats.acc.dtype
    lp = source_logits(partial, query, eps)
    m = torch.maximum(stats.max, lp)
    a, b = torch.exp(stats.max - m), torch.exp(lp - m)
    num = a.unsqueeze(-1) * stats.acc + b.unsqueeze(-1) * partial.to(cd)
    return num / (a * stats.norm + b).unsqueeze(-1)
