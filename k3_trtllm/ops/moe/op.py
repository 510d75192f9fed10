"""Reference implementations of ``k3::situ_moe`` and ``k3::situ_moe_mxfp4`` (contract.py),
registered at import. Validation lives here; the math is in naive.py."""
from __future__ import annotations

import torch

from .. import registry
from ..contract import SITU_MOE, SITU_MOE_MXFP4
from .mxfp4 import check_mxfp4_pair, dequantize_mxfp4
from .naive import grouping_applies, route, routed_experts

_ROUTER_DTYPES = (torch.float32, torch.float64)


def _check_routing(x, z, router_weight, correction_bias, num_experts, top_k, num_expert_group,
                   topk_group, scoring, renormalize, activation, situ_beta, situ_linear_beta) -> None:
    if x.dim() != 2 or not x.is_floating_point():
        raise ValueError(f"x: expected a 2-D float tensor [T, D], got {x.dtype} {list(x.shape)}")
    if z.dim() != 2 or z.shape[0] != x.shape[0]:
        raise ValueError(f"z: expected [T, L] with T = {x.shape[0]} (x's rows), got {list(z.shape)}")
    if z.dtype != x.dtype:
        raise ValueError(f"z: expected the activation dtype of x ({x.dtype}), got {z.dtype}")
    if num_experts < 1:
        raise ValueError(f"num_experts: expected >= 1, got {num_experts}")
    if router_weight.dtype not in _ROUTER_DTYPES or tuple(router_weight.shape) != (num_experts, x.shape[1]):
        raise ValueError(f"router_weight: expected fp32 [num_experts, D] = [{num_experts}, {x.shape[1]}], "
                         f"got {router_weight.dtype} {list(router_weight.shape)}")
    if correction_bias.dtype not in _ROUTER_DTYPES or tuple(correction_bias.shape) != (num_experts,):
        raise ValueError(f"correction_bias: expected fp32 [num_experts] = [{num_experts}], "
                         f"got {correction_bias.dtype} {list(correction_bias.shape)}")
    if not 1 <= top_k <= num_experts:
        raise ValueError(f"top_k: expected 1 <= top_k <= num_experts = {num_experts}, got {top_k}")
    if num_expert_group < 1:
        raise ValueError(f"num_expert_group: expected >= 1, got {num_expert_group}")
    if grouping_applies(num_experts, num_expert_group):
        if not 1 <= topk_group <= num_expert_group:
            raise ValueError(f"topk_group: expected 1 <= topk_group <= num_expert_group = "
                             f"{num_expert_group}, got {topk_group}")
        reachable = topk_group * (num_experts // num_expert_group)
        if top_k > reachable:
            raise ValueError(f"top_k: {top_k} exceeds the {reachable} experts of the "
                             f"{topk_group} kept groups")
    for name, value in (("scoring", scoring), ("renormalize", renormalize), ("activation", activation)):
        if value not in (0, 1):
            raise ValueError(f"{name}: expected 0 or 1, got {value}")
    if activation == 1 and not (situ_beta > 0 and situ_linear_beta >= 0):
        raise ValueError(f"situ_beta / situ_linear_beta: expected beta > 0 and linear_beta >= 0, "
                         f"got {situ_beta} / {situ_linear_beta}")


def _check_experts(w13_shape, w2_shape, latent: int, num_experts: int, expert_offset: int,
                   w13_name: str, w2_name: str) -> None:
    """Shapes are the unpacked ones ([El, 2*I, L] and [El, L, I]); names are the tensors
    the caller passed, so MXFP4 errors name the packed tensors."""
    if len(w13_shape) != 3 or w13_shape[0] < 1:
        raise ValueError(f"{w13_name}: expected [El, 2*I, L] with El >= 1, got {list(w13_shape)}")
    if len(w2_shape) != 3 or w2_shape[0] != w13_shape[0]:
        raise ValueError(f"{w2_name}: expected [El, L, I] with El = {w13_shape[0]}, got {list(w2_shape)}")
    if w13_shape[2] != latent:
        raise ValueError(f"{w13_name}: input dim {w13_shape[2]} != L = {latent} (z's width)")
    if w2_shape[1] != latent:
        raise ValueError(f"{w2_name}: output dim {w2_shape[1]} != L = {latent} (z's width)")
    if w13_shape[1] != 2 * w2_shape[2]:
        raise ValueError(f"{w13_name}: rows {w13_shape[1]} != 2 * I = 2 * {w2_shape[2]} "
                         f"({w2_name}'s inner dim); expected [gate; up] rows")
    if expert_offset < 0 or expert_offset + w13_shape[0] > num_experts:
        raise ValueError(f"expert_offset: experts {expert_offset} .. {expert_offset + w13_shape[0] - 1} "
                         f"do not fit in num_experts = {num_experts}")


def _moe(x, z, router_weight, correction_bias, w13, w2, num_experts, top_k, num_expert_group, topk_group,
         expert_offset, scoring, renormalize, routed_scaling_factor, activation, situ_beta,
         situ_linear_beta):
    topk_ids, topk_weights = route(x, router_weight, correction_bias, top_k, num_expert_group, topk_group,
                                   scoring, bool(renormalize), routed_scaling_factor)
    return routed_experts(z, topk_ids, topk_weights, w13, w2, expert_offset, activation, situ_beta,
                          situ_linear_beta)


def situ_moe_reference(x, z, router_weight, correction_bias, w13, w2, num_experts, top_k,
                       num_expert_group, topk_group, expert_offset, scoring, renormalize,
                       routed_scaling_factor, activation, situ_beta, situ_linear_beta):
    _check_routing(x, z, router_weight, correction_bias, num_experts, top_k, num_expert_group, topk_group,
                   scoring, renormalize, activation, situ_beta, situ_linear_beta)
    for name, w in (("w13", w13), ("w2", w2)):
        if w.dtype != z.dtype:
            raise ValueError(f"{name}: expected the activation dtype {z.dtype}, got {w.dtype}")
    _check_experts(tuple(w13.shape), tuple(w2.shape), z.shape[1], num_experts, expert_offset, "w13", "w2")
    return _moe(x, z, router_weight, correction_bias, w13, w2, num_experts, top_k, num_expert_group,
                topk_group, expert_offset, scoring, renormalize, routed_scaling_factor, activation,
                situ_beta, situ_linear_beta)


def situ_moe_mxfp4_reference(x, z, router_weight, correction_bias, w13_packed, w13_scale, w2_packed,
                             w2_scale, num_experts, top_k, num_expert_group, topk_group, expert_offset,
                             scoring, renormalize, routed_scaling_factor, activation, situ_beta,
                             situ_linear_beta):
    """W4A16: the experts are dequantized to z's dtype (exact for bf16), then the bf16 path."""
    _check_routing(x, z, router_weight, correction_bias, num_experts, top_k, num_expert_group, topk_group,
                   scoring, renormalize, activation, situ_beta, situ_linear_beta)
    w13_cols = check_mxfp4_pair(w13_packed, w13_scale, "w13_packed", "w13_scale")
    w2_cols = check_mxfp4_pair(w2_packed, w2_scale, "w2_packed", "w2_scale")
    _check_experts((*w13_packed.shape[:-1], w13_cols), (*w2_packed.shape[:-1], w2_cols), z.shape[1],
                   num_experts, expert_offset, "w13_packed", "w2_packed")
    w13 = dequantize_mxfp4(w13_packed, w13_scale, z.dtype)
    w2 = dequantize_mxfp4(w2_packed, w2_scale, z.dtype)
    return _moe(x, z, router_weight, correction_bias, w13, w2, num_experts, top_k, num_expert_group,
                topk_group, expert_offset, scoring, renormalize, routed_scaling_factor, activation,
                situ_beta, situ_linear_beta)


def _fake_output(x, z, *rest):
    return (z.new_empty(z.shape),)


registry.register(SITU_MOE, situ_moe_reference, _fake_output)
registry.register(SITU_MOE_MXFP4, situ_moe_mxfp4_reference, _fake_output)
