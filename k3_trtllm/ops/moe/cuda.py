"""CUDA implementations of ``k3::situ_moe`` and ``k3::situ_moe_mxfp4`` (ctypes over
``libk3_kernels.so``, sources in ``plugins/c_api/moe.cu`` and ``plugins/include/k3/moe/``).

Importing this module registers both kernels for CUDA tensors. They take bf16 activations,
fp32 router weight / correction bias and bf16 or MXFP4 experts; other dtypes (the fp32/fp64
exactness checks) and sizes the kernels are not built for fall through to the reference ops,
with one warning per distinct reason.
Arguments are validated by the reference's own checks, so errors read the same on both paths.
"""
from __future__ import annotations

import ctypes

import torch

from .. import registry
from ..c_abi import SITU_MOE_MXFP4_PARAMS, SITU_MOE_PARAMS
from ..contract import SITU_MOE, SITU_MOE_MXFP4
from . import reference as _reference  # importing defines the k3::situ_moe* ops
from ..cuda_library import check, fall_back, load_library, on_device_of, stream_of, unsupported_tensors

_LIB = load_library()
_p, _i, _f, _sz = ctypes.c_void_p, ctypes.c_int, ctypes.c_float, ctypes.c_size_t
_LIB.k3_moe_supported.argtypes = [_i] * 6
_LIB.k3_moe_supported.restype = _i
_LIB.k3_moe_workspace_size.argtypes = [_i] * 6
_LIB.k3_moe_workspace_size.restype = _sz
_LIB.k3_moe_route.argtypes = [_p] * 6 + [_i] * 8 + [_f, _p]
_LIB.k3_moe_route.restype = _i
_LIB.k3_situ_moe.argtypes = [ctypes.POINTER(SITU_MOE_PARAMS.structure), _p]  # const K3SituMoeParams*, stream
_LIB.k3_situ_moe.restype = _i
_LIB.k3_situ_moe_mxfp4.argtypes = [ctypes.POINTER(SITU_MOE_MXFP4_PARAMS.structure), _p]
_LIB.k3_situ_moe_mxfp4.restype = _i


def set_batch_invariant(enabled: bool) -> bool:
    """Process-wide MoE batch-invariant mode (default off; returns the previous setting): a
    token's output bits then do not depend on the other tokens of the call, since the kernels
    are chosen by the sizes alone (the tensor-core router logits and the tiled expert GEMMs for
    every token count; small batches otherwise take the router GEMV and the weight-streaming
    decode GEMMs, which round differently). Run-to-run determinism holds in both modes. Costs
    decode speed (bench/results/determinism_h200.json). Libraries without the switch (built
    before it) raise RuntimeError."""
    try:
        set_mode, get_mode = _LIB.k3_moe_set_batch_invariant, _LIB.k3_moe_batch_invariant
    except AttributeError:
        raise RuntimeError("the CUDA kernel library has no MoE batch-invariant mode: rebuild it with "
                           "build_scripts/build_kernels.sh") from None
    set_mode.argtypes, set_mode.restype, get_mode.restype = [_i], None, _i
    previous = bool(get_mode())
    set_mode(int(bool(enabled)))
    return previous


def route(x: torch.Tensor, router_weight: torch.Tensor, correction_bias: torch.Tensor, top_k: int,
          num_expert_group: int, topk_group: int, scoring: int, renormalize: bool,
          routed_scaling_factor: float, logits: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The CUDA router alone: ``topk_ids`` int32 ``[T, k]`` (best biased score first) and
    ``topk_weights`` fp32 ``[T, k]``; bf16 ``x``, fp32 ``router_weight`` / ``correction_bias``.
    ``logits``: optional fp32 ``[T, E]`` scratch, left holding the router logits."""
    num_tokens, num_experts = x.shape[0], router_weight.shape[0]
    ids = torch.empty(num_tokens, top_k, dtype=torch.int32, device=x.device)
    weights = torch.empty(num_tokens, top_k, dtype=torch.float32, device=x.device)
    if logits is None:
        logits = torch.empty(max(1, num_tokens * num_experts), dtype=torch.float32, device=x.device)
    elif (logits.dtype != torch.float32 or logits.device != x.device or not logits.is_contiguous()
          or logits.numel() < num_tokens * num_experts):
        raise ValueError(f"logits: expected a contiguous fp32 tensor of {num_tokens * num_experts} elements on "
                         f"{x.device}, got {logits.dtype} {tuple(logits.shape)} on {logits.device}")
    with on_device_of(x):
        status = _LIB.k3_moe_route(
            x.data_ptr(), router_weight.data_ptr(), correction_bias.data_ptr(), logits.data_ptr(), ids.data_ptr(),
            weights.data_ptr(), num_tokens, x.shape[1], num_experts, top_k, num_expert_group, topk_group, scoring,
            int(renormalize), float(routed_scaling_factor), stream_of(x))
    check(status, "k3_moe_route")
    return ids, weights


def _launch(entry, params, inputs, inter, num_local, attrs):
    """``entry`` over the contract ``inputs`` (the struct ``params`` of c_abi) and ``attrs``."""
    x, z = inputs[0], inputs[1]
    num_experts, top_k = attrs[0], attrs[1]
    out = torch.empty_like(z)
    if x.shape[0] == 0:
        return out
    with on_device_of(x):
        size = _LIB.k3_moe_workspace_size(x.shape[0], num_experts, top_k, num_local, z.shape[1], inter)
        ws = torch.empty(max(size, 1), dtype=torch.uint8, device=x.device)
        launch = params.fill(inputs, (out,), attrs, ws, ws.numel())
        status = entry(ctypes.byref(launch), stream_of(x))
    check(status, entry.__name__)
    return out


def _unsupported_sizes(attrs, num_local: int, latent: int, inter: int) -> str | None:
    num_experts, top_k, num_expert_group = attrs[0], attrs[1], attrs[2]
    if _LIB.k3_moe_supported(num_experts, num_local, top_k, num_expert_group, latent, inter):
        return None
    return (f"{num_experts} experts ({num_local} local), top_k {top_k}, {num_expert_group} expert groups, "
            f"latent {latent}, intermediate {inter}")


_ROUTER = {"x": torch.bfloat16, "z": torch.bfloat16, "router_weight": torch.float32,
           "correction_bias": torch.float32}


def situ_moe_cuda(x, z, router_weight, correction_bias, w13, w2, *attrs):
    args = (x, z, router_weight, correction_bias, w13, w2, *attrs)
    dims = _reference.check_call(SITU_MOE, *args)
    num_local, inter = dims["El"], dims["I"]
    tensors = {"x": x, "z": z, "router_weight": router_weight, "correction_bias": correction_bias,
               "w13": w13, "w2": w2}
    reason = (unsupported_tensors(tensors, {**_ROUTER, "w13": torch.bfloat16, "w2": torch.bfloat16})
              or _unsupported_sizes(attrs, num_local, dims["L"], inter))
    if reason is not None:
        return fall_back("situ_moe", reason, _reference.situ_moe_reference, *args)
    return _launch(_LIB.k3_situ_moe, SITU_MOE_PARAMS, (x, z, router_weight, correction_bias, w13, w2), inter,
                   num_local, attrs)


def situ_moe_mxfp4_cuda(x, z, router_weight, correction_bias, w13_packed, w13_scale, w2_packed, w2_scale, *attrs):
    args = (x, z, router_weight, correction_bias, w13_packed, w13_scale, w2_packed, w2_scale, *attrs)
    dims = _reference.check_call(SITU_MOE_MXFP4, *args)
    num_local, inter = dims["El"], dims["I"]
    tensors = {"x": x, "z": z, "router_weight": router_weight, "correction_bias": correction_bias,
               "w13_packed": w13_packed, "w2_packed": w2_packed}
    reason = (unsupported_tensors(tensors, _ROUTER)
              or ("a non-contiguous expert scale" if not (w13_scale.is_contiguous() and w2_scale.is_contiguous())
                  else _unsupported_sizes(attrs, num_local, dims["L"], inter)))
    if reason is not None:
        return fall_back("situ_moe_mxfp4", reason, _reference.situ_moe_mxfp4_reference, *args)
    return _launch(_LIB.k3_situ_moe_mxfp4, SITU_MOE_MXFP4_PARAMS,
                   (x, z, router_weight, correction_bias, w13_packed, w13_scale, w2_packed, w2_scale), inter,
                   num_local, attrs)


registry.register_kernel(SITU_MOE, "CUDA", situ_moe_cuda)
registry.register_kernel(SITU_MOE_MXFP4, "CUDA", situ_moe_mxfp4_cuda)
