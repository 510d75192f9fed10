"""CUDA implementations of ``k3::kda_prefill`` / ``k3::kda_decode`` (plugins/kernels/kda.cu).

Importing this module installs them for the CUDA device, as the MLA and MoE bindings do. The
kernels take bf16 activations, an fp32 state and head_dim 32/64/128 with conv width 2-4; any
other call on CUDA runs the fp32 reference implementation (plain torch, any device), with one
warning per distinct reason.
"""
from __future__ import annotations

import ctypes

import torch

from ..ops import registry
from ..ops.contract import KDA_DECODE, KDA_PREFILL
from ..ops.kda import op as reference
from . import check, fall_back, load_library

# contract inputs (11 pointers), out, workspace; T, B, H, head_dim, conv width; lower bound; stream
_ARGTYPES = [ctypes.c_void_p] * 13 + [ctypes.c_int] * 5 + [ctypes.c_float, ctypes.c_void_p]
_lib: ctypes.CDLL | None = None


def _library() -> ctypes.CDLL:
    global _lib
    if _lib is None:
        lib = load_library()
        for name in ("k3_kda_prefill", "k3_kda_decode"):
            fn = getattr(lib, name)
            fn.argtypes = _ARGTYPES
            fn.restype = ctypes.c_int
        lib.k3_kda_supported.argtypes = [ctypes.c_int, ctypes.c_int]
        lib.k3_kda_supported.restype = ctypes.c_int
        lib.k3_kda_prefill_workspace_bytes.argtypes = [ctypes.c_int] * 4 + [ctypes.c_float]
        lib.k3_kda_prefill_workspace_bytes.restype = ctypes.c_size_t
        _lib = lib
    return _lib


def _unsupported(qkv, conv_weight, conv_state, recurrent_state, head_dim) -> str | None:
    """Why the kernels cannot take the call, or None when they can."""
    for name, t, want in (("qkv", qkv, torch.bfloat16), ("conv_state", conv_state, torch.bfloat16),
                          ("recurrent_state", recurrent_state, torch.float32)):
        if t.dtype != want:
            return f"{name} of dtype {str(t.dtype).removeprefix('torch.')} (they take " \
                   f"{str(want).removeprefix('torch.')})"
    if not _library().k3_kda_supported(head_dim, conv_weight.shape[1]):
        return f"head_dim {head_dim} with conv width {conv_weight.shape[1]} (built for head_dim 32/64/128, " \
               "conv width 2-4)"
    return None


def _check_shapes(qkv, gate, beta, conv_weight, A_log, dt_bias, cu_seqlens, state_slots,
                  has_initial_state, conv_state, recurrent_state, H, K, lower_bound) -> None:
    """The contract's shapes and dtypes, without reading device values (no host sync)."""
    T, P = qkv.shape[0], H * K
    W = conv_weight.shape[1]
    S = conv_state.shape[0]
    B = cu_seqlens.shape[0] - 1
    expected = (("qkv", qkv, (T, 3 * P)), ("gate", gate, (T, P)), ("beta", beta, (T, H)),
                ("conv_weight", conv_weight, (3 * P, W)), ("A_log", A_log, (H,)),
                ("dt_bias", dt_bias, (P,)), ("state_slots", state_slots, (B,)),
                ("has_initial_state", has_initial_state, (B,)),
                ("conv_state", conv_state, (S, 3 * P, W - 1)),
                ("recurrent_state", recurrent_state, (S, H, K, K)))
    for name, t, shape in expected:
        if tuple(t.shape) != shape:
            raise ValueError(f"kda: {name} must have shape {list(shape)}, got {list(t.shape)}")
    for name, t in (("cu_seqlens", cu_seqlens), ("state_slots", state_slots),
                    ("has_initial_state", has_initial_state)):
        if t.dtype != torch.int32 or not t.is_cuda:
            raise ValueError(f"kda: {name} must be an int32 CUDA tensor, got {t.dtype} on {t.device}")
    if not (lower_bound == 0.0 or -5.0 <= lower_bound < 0.0):
        raise ValueError(f"kda: lower_bound must be in [-5, 0) or 0.0 (softplus gate), got {lower_bound}")
    for name, t in (("conv_state", conv_state), ("recurrent_state", recurrent_state)):
        if not t.is_contiguous():
            raise ValueError(f"kda: {name} is updated in place and must be contiguous")


def _make_impl(op_name: str, launcher_name: str, reference_fn):
    def impl(qkv, gate, beta, conv_weight, A_log, dt_bias, cu_seqlens, state_slots,
             has_initial_state, conv_state, recurrent_state, num_heads, head_dim, lower_bound):
        args = (qkv, gate, beta, conv_weight, A_log, dt_bias, cu_seqlens, state_slots,
                has_initial_state, conv_state, recurrent_state, num_heads, head_dim, lower_bound)
        reason = _unsupported(qkv, conv_weight, conv_state, recurrent_state, head_dim)
        if reason is not None:
            return fall_back(op_name, reason, reference_fn, *args)
        _check_shapes(*args)
        inputs = [t.contiguous() for t in (qkv, gate, beta.to(qkv.dtype))]
        params = [t.float().contiguous() for t in (conv_weight, A_log, dt_bias)]
        index = [t.contiguous() for t in (cu_seqlens, state_slots, has_initial_state)]
        T, B = qkv.shape[0], cu_seqlens.shape[0] - 1
        out = qkv.new_empty(T, num_heads * head_dim)
        lib = _library()
        work_bytes = lib.k3_kda_prefill_workspace_bytes(T, B, num_heads, head_dim, float(lower_bound)) \
            if launcher_name == "k3_kda_prefill" else 0
        work = torch.empty(work_bytes, dtype=torch.uint8, device=qkv.device)
        status = getattr(lib, launcher_name)(
            *(t.data_ptr() for t in inputs + params + index),
            conv_state.data_ptr(), recurrent_state.data_ptr(), out.data_ptr(),
            work.data_ptr() if work_bytes else None,
            T, B, num_heads, head_dim, conv_weight.shape[1],
            float(lower_bound), torch.cuda.current_stream(qkv.device).cuda_stream,
        )
        check(status, launcher_name)
        return out

    return impl


registry.register_kernel(KDA_PREFILL, "CUDA", _make_impl("kda_prefill", "k3_kda_prefill", reference.kda_prefill))
registry.register_kernel(KDA_DECODE, "CUDA", _make_impl("kda_decode", "k3_kda_decode", reference.kda_decode))
