"""Reference of the fused residual-stream ops (the kernels in ``plugins/include/k3/norm/``): each
is the composition of ``common`` / ``attn_res`` ops that the model ran before the kernels, in
the same order, so a model on this path computes exactly what it computed then."""
from __future__ import annotations

import torch

from ..attn_res import mix
from ..common import rms_norm


def sigmoid_gate(x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
    """The MLA output gate (spec §4.4): x * sigmoid(gate) in fp32, one rounding to x's dtype."""
    return (x.float() * torch.sigmoid(gate.float())).to(x.dtype)


# A sub-layer's output: one tensor, or the terms it is the sum of (see partial_sum), or none.
Residual = torch.Tensor | tuple[torch.Tensor, ...] | None


def partial_sum(partial: torch.Tensor, residual: Residual) -> torch.Tensor:
    """P + a, where the sub-layer output a may come as the terms it is the sum of (the latent
    MoE's routed and shared experts), added first, in order, in the stream's dtype."""
    if residual is None:
        return partial
    if not isinstance(residual, torch.Tensor):
        first, *rest = residual
        for term in rest:
            first = first + term
        residual = first
    return partial + residual


def attn_res_mix_norm(sources: list[torch.Tensor], residual: Residual, query: torch.Tensor, eps: float,
                      norm_weight: torch.Tensor, norm_eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """A sub-layer's input (spec §4.7.2): the partial sum P = sources[-1] (+ ``residual``, the
    previous sub-layer's output, when given: a tensor or its terms, see ``partial_sum``), the
    AttnRes mix of the blocks ``sources[:-1]`` and P in fp32, its RMSNorm rounded once to P's
    dtype. Returns (normed input, P)."""
    partial = partial_sum(sources[-1], residual)
    h = mix(list(sources[:-1]) + [partial], query, eps)
    return rms_norm(h, norm_weight, norm_eps).to(partial.dtype), partial


def attn_res_final_norm(sources: list[torch.Tensor], residual: Residual, query: torch.Tensor, eps: float,
                        rows: torch.Tensor, norm_weight: torch.Tensor, norm_eps: float) -> torch.Tensor:
    """The model's output rows ``rows``: the final AttnRes mix rounded to the stream's dtype,
    then the final RMSNorm (``ln_f``), as ``K3ForCausalLM`` computes them."""
    partial = partial_sum(sources[-1], residual)
    final = mix(list(sources[:-1]) + [partial], query, eps).to(partial.dtype)
    return rms_norm(final[rows.long()], norm_weight, norm_eps)
