"""ctypes binding of the residual-stream kernels (``plugins/c_api/norm.cu``, ``k3/norm_api.h``):
RMSNorm, the KDA output's gated RMSNorm, the AttnRes mix fused with its residual add and norm,
and the MLP's gated activation. The Structures below mirror the C params structs field by field.

Each function takes what its reference takes (``reference.py``, ``..common``) and returns what it
returns, for bf16 activations on CUDA; a call the kernels do not cover (see ``_why_not``) runs the
reference, with one warning per distinct reason. Nothing here reads device values, so every call
can be captured into a CUDA graph.
"""
from __future__ import annotations

import ctypes

import torch

from .. import common
from ..c_abi import packer
from ..cuda_library import check, fall_back, load_library, stream_of
from . import reference

MAX_SOURCES = 16  # K3_ATTN_RES_MAX_SOURCES
MAX_MIX_DIM = 10240  # K3_ATTN_RES_MAX_DIM
_WEIGHT_NONE, _WEIGHT_BF16, _WEIGHT_FP32 = 0, 1, 2
_p, _i, _i64, _f = ctypes.c_void_p, ctypes.c_int, ctypes.c_int64, ctypes.c_float
_NO_SOURCES = (0,) * MAX_SOURCES  # the unused source pointers


class RmsNormParams(ctypes.Structure):
    _fields_ = [("x", _p), ("x_token_stride", _i64), ("x_head_stride", _i64),
                ("gate", _p), ("gate_token_stride", _i64), ("gate_head_stride", _i64),
                ("weight", _p), ("weight_type", _i), ("out", _p), ("tokens", _i), ("heads", _i), ("dim", _i),
                ("eps", _f)]


class AttnResMixParams(ctypes.Structure):
    _fields_ = [("sources", _p * MAX_SOURCES), ("num_sources", _i), ("residual", _p), ("residual2", _p),
                ("partial_out", _p),
                ("rows", _p), ("query", _p), ("eps", _f), ("norm_weight", _p), ("norm_weight_type", _i),
                ("norm_eps", _f), ("round_mix", _i), ("out", _p), ("out_tokens", _i), ("dim", _i)]


class GluParams(ctypes.Structure):
    _fields_ = [("gate", _p), ("up", _p), ("gate_row_stride", _i64), ("up_row_stride", _i64), ("out", _p),
                ("tokens", _i), ("inter", _i),
                ("activation", _i), ("beta", _f), ("linear_beta", _f)]


# Each launch's params are packed into bytes laid out as the Structure above (``c_abi.packer``, a
# fraction of the Structure constructor's cost) and passed as the launcher's params pointer.
_RMS_NORM, _ATTN_RES_MIX, _GLU = packer(RmsNormParams), packer(AttnResMixParams), packer(GluParams)
_lib: ctypes.CDLL | None = None


def _library() -> ctypes.CDLL:
    global _lib
    if _lib is None:
        lib = load_library()
        for name in ("k3_rms_norm", "k3_attn_res_mix_norm", "k3_glu"):
            fn = getattr(lib, name)
            fn.argtypes = [_p, _p]  # const K3<...>Params* (packed bytes), stream
            fn.restype = _i
        _lib = lib
    return _lib


def _weight(w: torch.Tensor | None) -> tuple[int | None, int] | None:
    """(pointer, K3_NORM_WEIGHT_*) of a norm weight read in its stored dtype, None if the kernels
    cannot read it (fp64, not contiguous, another device)."""
    if w is None:
        return None, _WEIGHT_NONE
    if w.dim() != 1 or not w.is_contiguous() or not w.is_cuda:
        return None
    kind = {torch.bfloat16: _WEIGHT_BF16, torch.float32: _WEIGHT_FP32}.get(w.dtype)
    return None if kind is None else (w.data_ptr(), kind)


def _dtype_name(t: torch.Tensor) -> str:
    return str(t.dtype).removeprefix("torch.")


def _why_not(tensors: dict[str, torch.Tensor | None], weights: dict[str, torch.Tensor | None],
             dim: int | None = None) -> str | None:
    """Why the kernels cannot take these operands (bf16 activations with a contiguous last dim and
    bf16/fp32 1-D weights of length ``dim``, all on the first tensor's CUDA device), or None: a
    pointer from another device or a short weight would be read as if it were valid. Alignment is
    the launcher's: it picks its vector width."""
    device = next(t.device for t in tensors.values() if t is not None)
    for name, t in tensors.items():
        if t is None:
            continue
        if t.device != device:
            return f"{name} on {t.device} (the other operands are on {device})"
        if t.dtype != torch.bfloat16:
            return f"{name} of dtype {_dtype_name(t)} (they take bfloat16)"
        if t.dim() and t.stride(-1) != 1:
            return f"{name} with a strided last dim"
    for name, w in weights.items():
        if w is not None and w.device != device:
            return f"{name} on {w.device} (the other operands are on {device})"
        if _weight(w) is None:
            return f"{name} of dtype {_dtype_name(w)}, shape {list(w.shape)} (they take a contiguous 1-D bf16/fp32 " \
                   "weight)"
        if w is not None and w.shape[0] != dim:
            return f"{name} of length {w.shape[0]} for rows of {dim}"
    return None


# The checks above name what they reject, which costs string work on every call; these decide the
# common case (every operand readable) with attribute reads alone, and a call they do not accept
# goes through ``_why_not`` for its reason (they accept nothing ``_why_not`` rejects).
_BF16 = torch.bfloat16
_WEIGHT_KINDS = {torch.bfloat16: _WEIGHT_BF16, torch.float32: _WEIGHT_FP32}


def _readable(device: torch.device, tensors) -> bool:
    """Every tensor bf16 on ``device`` with a contiguous last dim."""
    for t in tensors:
        if t.dtype != _BF16 or t.device != device or not (t.is_contiguous() or t.stride(-1) == 1):
            return False
    return True


def _dense_rows(device: torch.device, shape: torch.Size, tensors) -> bool:
    """Every tensor a contiguous bf16 tensor of ``shape`` on ``device`` (as the model makes the mixes'
    operands)."""
    for t in tensors:
        if t.shape != shape or t.dtype != _BF16 or t.device != device or not t.is_contiguous():
            return False
    return True


def _weight_readable(device: torch.device, w: torch.Tensor | None, dim: int) -> bool:
    """``w`` None, or a contiguous 1-D bf16/fp32 CUDA weight of length ``dim`` on ``device``."""
    return w is None or (w.dtype in _WEIGHT_KINDS and w.dim() == 1 and w.shape[0] == dim and w.is_cuda
                         and w.device == device and w.is_contiguous())


def _launch(fn, params: bytes, stream: int, what) -> None:
    """Call a launcher with its packed params; ``what()`` names the call in the error (built only
    when there is one)."""
    status = fn(params, stream)
    if status:
        check(status, what())


def rms_norm(x: torch.Tensor, weight: torch.Tensor | None, eps: float) -> torch.Tensor:
    """``common.rms_norm`` of bf16 CUDA rows [T, d] (rows may be strided: split views)."""
    return _norm(x, weight, None, eps)


def gated_rms_norm(x: torch.Tensor, weight: torch.Tensor, gate: torch.Tensor, eps: float) -> torch.Tensor:
    """``common.gated_rms_norm`` of [T, H, D] views (x and gate may be strided over T and H)."""
    return _norm(x, weight, gate, eps)


def _norm(x, weight, gate, eps):
    shape, device = x.shape, x.device
    fast = (len(shape) == (2 if gate is None else 3) and not shape[-1] % 2
            and (gate is None or (gate.shape == shape and _readable(device, (gate,))))
            and _readable(device, (x,)) and _weight_readable(device, weight, shape[-1]))
    if not fast:
        reason = _norm_reason(x, weight, gate)
        if reason is not None:
            op, ref = ("rms_norm", common.rms_norm) if gate is None else ("gated_rms_norm", common.gated_rms_norm)
            return fall_back(op, reason, ref, *((x, weight, eps) if gate is None else (x, weight, gate, eps)))
    out = torch.empty(shape, dtype=x.dtype, device=device)
    w_ptr, w_type = (0, _WEIGHT_NONE) if weight is None else (weight.data_ptr(), _WEIGHT_KINDS[weight.dtype])
    if gate is None:
        p = _RMS_NORM.pack(x.data_ptr(), x.stride(0), 0, 0, 0, 0, w_ptr, w_type, out.data_ptr(), shape[0], 1,
                           shape[-1], eps)
    else:
        p = _RMS_NORM.pack(x.data_ptr(), x.stride(0), x.stride(1), gate.data_ptr(), gate.stride(0), gate.stride(1),
                           w_ptr, w_type, out.data_ptr(), shape[0], shape[1], shape[-1], eps)
    _launch(_library().k3_rms_norm, p, stream_of(x), lambda: f"k3_rms_norm (x {list(x.shape)} {x.stride()})")
    return out


def _norm_reason(x, weight, gate) -> str | None:
    """Why the norm kernel cannot take the operands, or None."""
    reason = _why_not({"x": x, "gate": gate}, {"weight": weight}, x.shape[-1] if x.dim() else None)
    if reason is None and gate is None and x.dim() != 2:
        reason = f"x of shape {list(x.shape)} (they take [T, d] rows)"
    if reason is None and gate is not None and (x.dim() != 3 or gate.shape != x.shape):
        reason = f"x {list(x.shape)} with gate {list(gate.shape)} (they take two [T, H, D] views)"
    if reason is None and x.shape[-1] % 2:
        reason = f"an odd last dim ({x.shape[-1]})"
    return reason


def _residual_terms(residual) -> tuple[torch.Tensor, ...]:
    """A sub-layer output given as one tensor, None, or the terms it is the sum of."""
    if residual is None:
        return ()
    return (residual,) if isinstance(residual, torch.Tensor) else tuple(residual)


def _mix_operands(sources, terms, query, norm_weight) -> tuple[list, list] | str:
    """(sources, residual terms) as the kernel reads them (dense rows), or why it cannot take them.
    The common case, contiguous operands as the model makes them, is decided by attribute reads
    alone; anything else by the named checks, and then copied dense."""
    if 1 <= len(sources) <= MAX_SOURCES and len(terms) <= 2:
        last = sources[-1]
        shape, device = last.shape, last.device
        if (len(shape) == 2 and shape[1] <= MAX_MIX_DIM and not shape[1] % 2 and _dense_rows(device, shape, sources)
                and _dense_rows(device, shape, terms) and _weight_readable(device, norm_weight, shape[1])
                and query.dtype == torch.float32 and query.device == device and query.shape == (shape[1],)
                and query.is_contiguous()):
            return sources, terms
    reason = _mix_reason(sources, terms, query, norm_weight)
    if reason is not None:
        return reason
    # rows with a stride: the kernel reads dense ones (the copies live until the launch)
    return [s.contiguous() for s in sources], [r.contiguous() for r in terms]


def _mix_reason(sources, terms, query, norm_weight) -> str | None:
    if not 1 <= len(sources) <= MAX_SOURCES:
        return f"{len(sources)} sources (they take 1..{MAX_SOURCES})"
    if len(terms) > 2:
        return f"a residual of {len(terms)} terms (they add up to 2)"
    reason = _why_not({f"sources[{i}]": s for i, s in enumerate(sources)} |
                      {f"residual[{i}]": r for i, r in enumerate(terms)},
                      {"norm_weight": norm_weight}, sources[-1].shape[-1] if sources[-1].dim() else None)
    if reason is not None:
        return reason
    shape = sources[-1].shape
    if len(shape) != 2 or shape[1] > MAX_MIX_DIM or shape[1] % 2:
        return f"sources of shape {list(shape)} (they take [T, d], even d <= {MAX_MIX_DIM})"
    if any(s.shape != shape for s in sources) or any(r.shape != shape for r in terms):
        return "sources or residual of differing shapes"
    if query.device != sources[-1].device:
        return f"a query on {query.device} (the sources are on {sources[-1].device})"
    if query.dtype != torch.float32 or query.shape != (shape[1],) or not query.is_contiguous():
        return f"a query of dtype {_dtype_name(query)}, shape {list(query.shape)} (they take fp32 [d])"
    return None


def _mix_call(sources, terms, query, eps, norm_weight, norm_eps, rows, partial_out, round_mix):
    """Launches the fused mix over dense operands (``_mix_operands``); returns the normed output rows."""
    residual, residual2 = ([r.data_ptr() for r in terms] + [0, 0])[:2]
    first = sources[0]
    out_tokens = rows.shape[0] if rows is not None else first.shape[0]
    out = torch.empty(out_tokens, first.shape[1], dtype=first.dtype, device=first.device)
    w_ptr, w_type = (0, _WEIGHT_NONE) if norm_weight is None else (norm_weight.data_ptr(),
                                                                    _WEIGHT_KINDS[norm_weight.dtype])
    ptrs = [s.data_ptr() for s in sources]
    p = _ATTN_RES_MIX.pack(*ptrs, *_NO_SOURCES[len(ptrs):], len(ptrs), residual, residual2,
                           partial_out.data_ptr() if partial_out is not None else 0,
                           rows.data_ptr() if rows is not None else 0, query.data_ptr(), eps, w_ptr, w_type,
                           norm_eps, int(round_mix), out.data_ptr(), out_tokens, first.shape[1])
    _launch(_library().k3_attn_res_mix_norm, p, stream_of(out),
            lambda: f"k3_attn_res_mix_norm ({len(sources)} sources {list(first.shape)}, {out_tokens} rows)")
    return out


def attn_res_mix_norm(sources, residual, query, eps, norm_weight, norm_eps):
    """``reference.attn_res_mix_norm`` in one kernel: (normed bf16 input, partial sum)."""
    operands = _mix_operands(sources, _residual_terms(residual), query, norm_weight)
    if isinstance(operands, str):
        return fall_back("attn_res_mix_norm", operands, reference.attn_res_mix_norm, sources, residual, query, eps,
                         norm_weight, norm_eps)
    sources, terms = operands
    # without a residual the partial sum is the last source itself, and no copy is written
    partial = torch.empty_like(sources[-1]) if terms else sources[-1]
    out = _mix_call(sources, terms, query, eps, norm_weight, norm_eps, None, partial if terms else None, False)
    return out, partial


def attn_res_final_norm(sources, residual, query, eps, rows, norm_weight, norm_eps):
    """``reference.attn_res_final_norm`` in one kernel, over the ``rows`` tokens only."""
    operands = _mix_operands(sources, _residual_terms(residual), query, norm_weight)
    if not isinstance(operands, str) and (rows.dtype != torch.int32 or rows.dim() != 1
                                          or rows.device != sources[-1].device):
        operands = f"rows of dtype {_dtype_name(rows)} on {rows.device} (they take an int32 CUDA vector)"
    if isinstance(operands, str):
        return fall_back("attn_res_final_norm", operands, reference.attn_res_final_norm, sources, residual, query,
                         eps, rows, norm_weight, norm_eps)
    return _mix_call(*operands, query, eps, norm_weight, norm_eps, rows.contiguous(), None, True)


SIGMOID_GATE = 2  # K3_GLU_SIGMOID_GATE


def glu(gate: torch.Tensor, up: torch.Tensor, activation: int, beta: float, linear_beta: float) -> torch.Tensor:
    """``common.glu`` of two [T, inter] views (the halves of the fc product)."""
    return _glu("glu", common.glu, gate, up, activation, beta, linear_beta)


def sigmoid_gate(x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
    """``reference.sigmoid_gate`` (the MLA output gate) of two [T, n] views."""
    return _glu("sigmoid_gate", lambda g, u, *_: reference.sigmoid_gate(u, g), gate, x, SIGMOID_GATE, 0.0, 0.0)


def _glu(op, ref, gate, up, activation, beta, linear_beta):
    shape, device = gate.shape, gate.device
    if not (len(shape) == 2 and up.shape == shape and not shape[1] % 2 and not (activation == 1 and beta == 0.0)
            and _readable(device, (gate, up))):
        reason = _why_not({"gate": gate, "up": up}, {})
        if reason is None and (gate.dim() != 2 or gate.shape != up.shape):
            reason = f"gate {list(gate.shape)} and up {list(up.shape)} (they take two [T, n] views of one shape)"
        if reason is None and (gate.shape[1] % 2 or (activation == 1 and beta == 0.0)):
            reason = f"an odd width ({gate.shape[1]}) or SiTU beta 0"
        if reason is not None:
            return fall_back(op, reason, ref, gate, up, activation, beta, linear_beta)
    tokens, inter = shape
    out = torch.empty(tokens, inter, dtype=gate.dtype, device=device)
    p = _GLU.pack(gate.data_ptr(), up.data_ptr(), gate.stride(0), up.stride(0), out.data_ptr(), tokens, inter,
                  int(activation), beta, linear_beta)
    _launch(_library().k3_glu, p, stream_of(out), lambda: f"k3_glu ({op}, {list(gate.shape)})")
    return out
