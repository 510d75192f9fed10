"""CUDA implementations of ``k3::kda_prefill`` / ``k3::kda_decode`` (plugins/c_api/kda.cu).

Importing this module installs them for the CUDA device, as the MLA and MoE bindings do. The
kernels take bf16 activations, an fp32 state and head_dim 32/64/128 with conv width 2-4; any
other call on CUDA runs the fp32 reference implementation (plain torch, any device), with one
warning per distinct reason. The prefill kernels write the prefix cache's snapshots themselves,
for both gate forms (chunked walk, or the token recurrence for the softplus gate).

Snapshot points are device values: the reference checks them on the host, which would cost a
device sync per call here. The kernels check them instead (chunk table kernel, in parallel with
its scan): a step with a bad entry takes no snapshot at all, and nothing is written out of
bounds. The verdict word comes back to pinned host memory behind the launch (a 4-byte copy on
the stream, no sync) and is read once its copy has completed (``verdicts.py``: one ring per
device): at the start of a later KDA call on that device, or by ``check_snapshot_verdicts()``,
which the torch executor runs after every step (those that landed) and, waiting, after a step
that took snapshots. Either raises ValueError naming snapshot_offsets / snapshot_rows. The
verdict depends on the step's snapshot table only (offsets, rows, cu_seqlens, pool rows), which
every KDA layer of a step shares: only a call with other table tensors (objects, storage, shape)
fetches its verdict. (Inference tensors keep no version counter, so a table rewritten in place
under the same tensors is not fetched again; the kernels refuse a bad one all the same.)
"""
from __future__ import annotations

import ctypes
import functools

import torch

from .. import registry
from ..c_abi import KDA
from ..capture import capturing
from ..contract import KDA_DECODE, KDA_PREFILL, OpContract
from . import reference, verdicts
from ..cuda_library import check, fall_back, load_library, stream_of
from .verdicts import check_snapshot_verdicts  # noqa: F401  (the binding's public check, re-exported)

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
        lib.k3_kda_prefill_snapshot_verdict_offset.argtypes = [ctypes.c_int]
        lib.k3_kda_prefill_snapshot_verdict_offset.restype = ctypes.c_size_t
        _lib = lib
    return _lib


@functools.lru_cache(maxsize=None)
def _built_for(head_dim: int, conv_width: int) -> bool:
    return bool(_library().k3_kda_supported(head_dim, conv_width))


def _unsupported(qkv, conv_weight, recurrent_state, snapshot_recurrent, head_dim) -> str | None:
    """Why the kernels cannot take the call, or None when they can."""
    # qkv's dtype is the activation dtype of gate, beta and conv_state too (the contract)
    for name, t, want in (("qkv", qkv, torch.bfloat16), ("recurrent_state", recurrent_state, torch.float32),
                          ("snapshot_recurrent", snapshot_recurrent, torch.float32)):
        if t.dtype != want:
            return f"{name} of dtype {str(t.dtype).removeprefix('torch.')} (they take " \
                   f"{str(want).removeprefix('torch.')})"
    if not _built_for(head_dim, conv_weight.shape[1]):
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
        if not capturing(qkv.device):  # event queries are not capture-safe
            check_snapshot_verdicts(wait=False, device=qkv.device)  # this device's earlier verdicts, landed
        reason = _unsupported(qkv, conv_weight, recurrent_state, snapshot_recurrent, head_dim)
        if reason is not None:
            return fall_back(contract.name, reason, reference_fn, *args)
        inputs = [t.contiguous() for t in (qkv, gate, beta.to(qkv.dtype))]
        params = [t.float().contiguous() for t in (conv_weight, A_log, dt_bias)]
        index = [t.contiguous() for t in (cu_seqlens, state_slots, has_initial_state)]
        snapshot_index = [t.contiguous() for t in (snapshot_offsets, snapshot_rows)]
        T, B = qkv.shape[0], cu_seqlens.shape[0] - 1
        out = qkv.new_empty(T, num_heads * head_dim)
        lib = _library()
        prefill = contract is KDA_PREFILL
        work = torch.empty(lib.k3_kda_prefill_workspace_bytes(T, B, num_heads, head_dim, float(lower_bound)),
                           dtype=torch.uint8, device=qkv.device) if prefill else None
        launch = KDA.fill((*inputs, *params, *index, conv_state, recurrent_state, *snapshot_index, snapshot_conv,
                           snapshot_recurrent), (out,), (num_heads, head_dim, lower_bound), work)
        status = getattr(lib, launcher_name)(ctypes.byref(launch), stream_of(qkv))
        if status:
            check(status, launcher_name)
        if prefill and B > 0:  # with no sequence the launcher returns before the table kernel
            def word() -> torch.Tensor:  # the verdict's 4 bytes in the workspace
                at = lib.k3_kda_prefill_snapshot_verdict_offset(B)
                return work[at:at + 4]
            verdicts.ring(qkv.device).watch(word, (*snapshot_index, index[0]), snapshot_recurrent.shape[0],
                                            f"{T} tokens of {B} sequences")
        return out

    return impl


registry.register_kernel(KDA_PREFILL, "CUDA", _make_impl(KDA_PREFILL, "k3_kda_prefill", reference.kda_prefill))
registry.register_kernel(KDA_DECODE, "CUDA", _make_impl(KDA_DECODE, "k3_kda_decode", reference.kda_decode))
