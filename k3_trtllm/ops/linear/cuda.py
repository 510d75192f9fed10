"""ctypes binding of the skinny bf16 linear (``plugins/c_api/linear.cu``, ``k3/linear_api.h``);
the Structure mirrors ``K3SkinnyLinearParams`` field by field. Nothing here reads device values,
so every call can be captured into a CUDA graph."""
from __future__ import annotations

import ctypes

import torch

from ..cuda_library import check, load_library

MAX_TOKENS = 4  # K3_SKINNY_MAX_TOKENS
_p, _i, _i64 = ctypes.c_void_p, ctypes.c_int, ctypes.c_int64


class SkinnyLinearParams(ctypes.Structure):
    _fields_ = [("x", _p), ("x_row_stride", _i64), ("weight", _p), ("out", _p), ("tokens", _i), ("n", _i),
                ("k", _i), ("out_fp32", _i)]


_lib: ctypes.CDLL | None = None
_available: bool | None = None


def _library() -> ctypes.CDLL:
    global _lib
    if _lib is None:
        lib = load_library()
        fn = lib.k3_skinny_linear
        fn.argtypes = [ctypes.POINTER(SkinnyLinearParams), _p]
        fn.restype = _i
        _lib = lib
    return _lib


def available() -> bool:
    """Whether the kernel library is built with the skinny linear (a library built before it has
    no k3_skinny_linear: then torch's linear runs, as without a library)."""
    global _available
    if _available is None:
        try:
            _library()
            _available = True
        except (FileNotFoundError, AttributeError):
            _available = False
    return _available


def why_not(x: torch.Tensor, weight: torch.Tensor) -> str | None:
    """Why the kernel cannot read these operands (bf16 on the current CUDA device, K a multiple
    of 8, 16-byte aligned rows, a contiguous weight of x's width), or None."""
    if weight.dtype != torch.bfloat16 or weight.device != x.device:
        return "the weight's dtype or device"
    if weight.dim() != 2 or weight.shape[1] != x.shape[1] or not weight.is_contiguous():
        return f"a weight of shape {list(weight.shape)} for rows of {x.shape[1]}"
    k = x.shape[1]
    if k % 8 or x.stride(1) != 1 or x.data_ptr() % 16 or weight.data_ptr() % 16:
        return "rows that are not 16-byte vectors"
    if x.shape[0] > 1 and (x.stride(0) % 8 or x.stride(0) < k):
        return "a row stride that is not a whole number of 16-byte rows"
    if x.get_device() != torch.cuda.current_device():  # the launch goes to the current device
        return "operands off the current device"
    return None


def linear(x: torch.Tensor, weight: torch.Tensor, out_fp32: bool = False) -> torch.Tensor:
    """``x @ weight.T`` of bf16 [T <= MAX_TOKENS, k] rows (``why_not`` is None): bf16, or fp32."""
    tokens, n = x.shape[0], weight.shape[0]
    out = torch.empty(tokens, n, dtype=torch.float32 if out_fp32 else x.dtype, device=x.device)
    p = SkinnyLinearParams(x=x.data_ptr(), x_row_stride=x.stride(0), weight=weight.data_ptr(), out=out.data_ptr(),
                           tokens=tokens, n=n, k=x.shape[1], out_fp32=int(out_fp32))
    check(_library().k3_skinny_linear(ctypes.byref(p), torch._C._cuda_getCurrentRawStream(x.get_device())),
          f"k3_skinny_linear (x {list(x.shape)} {x.stride()}, weight {list(weight.shape)})")
    return out
