"""CUDA implementations of ``k3::kda_prefill`` / ``k3::kda_decode`` (plugins/c_api/kda.cu).

Importing this module installs them for the CUDA device, as the MLA and MoE bindings do. The
kernels take bf16 activations, an fp32 state and head_dim 32/64/128 with conv width 2-4; any
other call on CUDA runs the fp32 reference implementation (plain torch, any device), with one
warning per distinct reason. The chunked prefill writes the prefix cache's snapshots itself;
the softplus gate's prefill (the token recurrence kernel) writes none, so a softplus prefill
that asks for snapshots runs the reference (checking that reads the offsets: a device sync,
for softplus configs only; K3's gate is bounded).
"""
from __future__ import annotations

import ctypes

import torch

from .. import registry
from ..c_abi import KDA
from ..contract import KDA_DECODE, KDA_PREFILL, OpContract
from . import reference
from ..cuda_library import check, fall_back, load_library

_ARGTYPES = [ctypes.POINTER(KDA.structure), ctypes.c_void_p]  # const K3KdaParams*, stream
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


def _unsupported(qkv, conv_weight, recurrent_state, snapshot_recurrent, head_dim) -> str | None:
    """Why the kernels cannot take the call, or None when they can."""
    # qkv's dtype is the activation dtype of gate, beta and conv_state too (the contract)
    for name, t, want in (("qkv", qkv, torch.bfloat16), ("recurrent_state", recurrent_state, torch.float32),
                          ("snapshot_recurrent", snapshot_recurrent, torch.float32)):
        if t.dtype != want:
            return f"{name} of dtype {str(t.dtype).removeprefix('torch.')} (they take " \
                   f"{str(want).removeprefix('torch.')})"
    if not _library().k3_kda_supported(head_dim, conv_weight.shape[1]):
        return f"head_dim {head_dim} with conv width {conv_weight.shape[1]} (built for head_dim 32/64/128, " \
               "conv width 2-4)"
    return None


def _make_impl(contract: OpContract, launcher_name: str, reference_fn):
    def impl(qkv, gate, beta, conv_weight, A_log, dt_bias, cu_seqlens, state_slots,
             has_initial_state, conv_state, recurrent_state, snapshot_offsets, snapshot_rows,
             snapshot_conv, snapshot_recurrent, num_heads, head_dim, lower_bound):
        args = (qkv, gate, beta, conv_weight, A_log, dt_bias, cu_seqlens, state_slots,
                has_initial_state, conv_state, recurrent_state, snapshot_offsets, snapshot_rows,
                snapshot_conv, snapshot_recurrent, num_heads, head_dim, lower_bound)
        # a call that breaks the contract raises on every path; neither check reads device values
        reference.check_attributes(num_heads, head_dim, lower_bound)
        contract.check(*args)
        reason = _unsupported(qkv, conv_weight, recurrent_state, snapshot_recurrent, head_dim)
        if reason is None and contract is KDA_PREFILL and lower_bound == 0.0 and bool((snapshot_offsets >= 0).any()):
            reason = "snapshots with the softplus gate (its token-recurrence prefill kernel writes none)"
        if reason is not None:
            return fall_back(contract.name, reason, reference_fn, *args)
        inputs = [t.contiguous() for t in (qkv, gate, beta.to(qkv.dtype))]
        params = [t.float().contiguous() for t in (conv_weight, A_log, dt_bias)]
        index = [t.contiguous() for t in (cu_seqlens, state_slots, has_initial_state)]
        snapshot_index = [t.contiguous() for t in (snapshot_offsets, snapshot_rows)]
        T, B = qkv.shape[0], cu_seqlens.shape[0] - 1
        out = qkv.new_empty(T, num_heads * head_dim)
        lib = _library()
        work_bytes = lib.k3_kda_prefill_workspace_bytes(T, B, num_heads, head_dim, float(lower_bound)) \
            if launcher_name == "k3_kda_prefill" else 0
        work = torch.empty(work_bytes, dtype=torch.uint8, device=qkv.device)
        launch = KDA.fill((*inputs, *params, *index, conv_state, recurrent_state, *snapshot_index, snapshot_conv,
                           snapshot_recurrent), (out,),
                          (num_heads, head_dim, lower_bound), work if work_bytes else None)
        status = getattr(lib, launcher_name)(ctypes.byref(launch),
                                             torch.cuda.current_stream(qkv.device).cuda_stream)
        check(status, launcher_name)
        return out

    return impl


registry.register_kernel(KDA_PREFILL, "CUDA", _make_impl(KDA_PREFILL, "k3_kda_prefill", reference.kda_prefill))
registry.register_kernel(KDA_DECODE, "CUDA", _make_impl(KDA_DECODE, "k3_kda_decode", reference.kda_decode))
