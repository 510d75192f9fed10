"""Readable routed latent-MoE math (spec §4.6): router top-k and the expert combine.

Works in any float dtype; the math runs in ``common.compute_dtype`` (fp32, or fp64 when
the activations are fp64).
"""
from __future__ import annotations

import torch

from ..common import compute_dtype, glu

# The contract's ``scoring`` attr (ops/contract.py): the config's router function -> its code.
SCORING = {"sigmoid": 0, "softmax": 1}


def grouping_applies(num_experts: int, num_expert_group: int) -> bool:
    """vLLM falls back to a plain top-k when the experts cannot be split into
    ``num_expert_group`` groups of at least two; one group is a no-op."""
    return num_expert_group > 1 and num_experts > num_expert_group and num_experts % num_expert_group == 0


def _keep_best_groups(s_sel: torch.Tensor, num_expert_group: int, topk_group: int) -> torch.Tensor:
    """Score each group of consecutive experts by the sum of its two best biased scores,
    keep the ``topk_group`` best groups and hide the others behind -inf."""
    tokens, num_experts = s_sel.shape
    grouped = s_sel.view(tokens, num_expert_group, num_experts // num_expert_group)
    group_score = grouped.topk(2, dim=-1).values.sum(dim=-1)
    best = group_score.topk(topk_group, dim=-1).indices
    keep = torch.zeros_like(group_score, dtype=torch.bool).scatter_(1, best, True)
    return grouped.masked_fill(~keep.unsqueeze(-1), float("-inf")).view(tokens, num_experts)


def route(x: torch.Tensor, router_weight: torch.Tensor, correction_bias: torch.Tensor, top_k: int,
          num_expert_group: int, topk_group: int, scoring: int, renormalize: bool,
          routed_scaling_factor: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Router of spec §4.6.1. Returns ``topk_ids`` int64 ``[T, k]`` (best biased score
    first) and ``topk_weights`` ``[T, k]`` in the compute dtype (fp32, fp64 for fp64 x).

    The correction bias only decides which experts are selected; the weights are the
    unbiased scores of the selected experts.
    """
    cd = compute_dtype(x.dtype)
    logits = x.to(cd) @ router_weight.to(cd).T
    scores = torch.sigmoid(logits) if scoring == SCORING["sigmoid"] else torch.softmax(logits, dim=-1)
    s_sel = scores + correction_bias.to(cd)
    if grouping_applies(scores.shape[-1], num_expert_group):
        s_sel = _keep_best_groups(s_sel, num_expert_group, topk_group)
    topk_ids = s_sel.topk(top_k, dim=-1).indices
    topk_weights = scores.gather(1, topk_ids)
    if renormalize:
        topk_weights = topk_weights / topk_weights.sum(dim=-1, keepdim=True)
    return topk_ids, topk_weights * routed_scaling_factor


def routed_experts(z: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor,
                   w13: torch.Tensor, w2: torch.Tensor, expert_offset: int, activation: int,
                   situ_beta: float, situ_linear_beta: float) -> torch.Tensor:
    """``out[t] = sum_e w[t, e] * W2_e · glu(W1_e z_t, W3_e z_t)`` over the selected experts
    that live on this rank (global ids ``expert_offset .. expert_offset + El - 1``); the
    others belong to other expert-parallel ranks and are skipped.

    gate/up stay in the compute dtype (a fused GEMM + activation epilogue never rounds
    them); ``h`` is rounded once to z's dtype because it is the activation-dtype operand
    of the down GEMM; ``y`` and the weighted sum stay in the compute dtype and the
    result is rounded once to z's dtype (spec §7.12-13).
    """
    cd = compute_dtype(z.dtype)
    inter = w2.shape[-1]
    out = torch.zeros(z.shape, dtype=cd, device=z.device)
    for local in range(w13.shape[0]):
        tokens, slots = torch.nonzero(topk_ids == expert_offset + local, as_tuple=True)
        if tokens.numel() == 0:
            continue
        gate_up = z[tokens].to(cd) @ w13[local].to(cd).T
        h = glu(gate_up[:, :inter], gate_up[:, inter:], activation, situ_beta, situ_linear_beta).to(z.dtype)
        y = h.to(cd) @ w2[local].to(cd).T
        out.index_add_(0, tokens, topk_weights[tokens, slots].to(cd).unsqueeze(-1) * y)
    return out.to(z.dtype)
