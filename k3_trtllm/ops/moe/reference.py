"""Reference implementations of ``k3::situ_moe`` and ``k3::situ_moe_mxfp4`` (contract.py),
registered at import. The contract checks shapes and dtypes; the routing bounds are checked
here; the math is in naive.py."""
from __future__ import annotations

from .. import registry
from ..contract import SITU_MOE, SITU_MOE_MXFP4
from ...mxfp4 import dequantize_mxfp4
from .naive import grouping_applies, route, routed_experts


def _check_attributes(num_experts, top_k, num_expert_group, topk_group, scoring, renormalize, activation,
                     situ_beta, situ_linear_beta) -> None:
    """The routing and activation attributes' bounds."""
    if num_experts < 1:
        raise ValueError(f"num_experts: expected >= 1, got {num_experts}")
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


def check_call(contract, *args) -> dict[str, int]:
    """Every check of a call of ``contract`` (either MoE op; the CUDA binding runs it too, so
    errors read the same on both paths): the attributes, the contract's shapes and dtypes, and
    the local experts' place among the global ones. Returns the dims."""
    (num_experts, top_k, num_expert_group, topk_group, expert_offset, scoring, renormalize, _,
     activation, situ_beta, situ_linear_beta) = args[len(contract.inputs):]
    _check_attributes(num_experts, top_k, num_expert_group, topk_group, scoring, renormalize, activation,
                     situ_beta, situ_linear_beta)
    dims = contract.check(*args)
    local = dims["El"]
    if local < 1:
        raise ValueError(f"{contract.inputs[4].name}: expected at least one local expert (El >= 1), got El = 0")
    if expert_offset < 0 or expert_offset + local > num_experts:
        raise ValueError(f"expert_offset: experts {expert_offset} .. {expert_offset + local - 1} "
                         f"do not fit in num_experts = {num_experts}")
    return dims


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
    attrs = (num_experts, top_k, num_expert_group, topk_group, expert_offset, scoring, renormalize,
             routed_scaling_factor, activation, situ_beta, situ_linear_beta)
    check_call(SITU_MOE, x, z, router_weight, correction_bias, w13, w2, *attrs)
    return _moe(x, z, router_weight, correction_bias, w13, w2, *attrs)


def situ_moe_mxfp4_reference(x, z, router_weight, correction_bias, w13_packed, w13_scale, w2_packed,
                             w2_scale, num_experts, top_k, num_expert_group, topk_group, expert_offset,
                             scoring, renormalize, routed_scaling_factor, activation, situ_beta,
                             situ_linear_beta):
    """W4A16: the experts are dequantized to z's dtype (exact for bf16), then the bf16 path."""
    attrs = (num_experts, top_k, num_expert_group, topk_group, expert_offset, scoring, renormalize,
             routed_scaling_factor, activation, situ_beta, situ_linear_beta)
    check_call(SITU_MOE_MXFP4, x, z, router_weight, correction_bias, w13_packed, w13_scale, w2_packed,
               w2_scale, *attrs)
    w13 = dequantize_mxfp4(w13_packed, w13_scale, z.dtype)
    w2 = dequantize_mxfp4(w2_packed, w2_scale, z.dtype)
    return _moe(x, z, router_weight, correction_bias, w13, w2, *attrs)


def _fake_output(x, z, *rest):
    return (z.new_empty(z.shape),)


registry.register(SITU_MOE, situ_moe_reference, _fake_output)
registry.register(SITU_MOE_MXFP4, situ_moe_mxfp4_reference, _fake_output)
