"""Batch-invariant mode (issue 23): a request's output bits do not depend on what else is in the
batch. Run-to-run determinism needs nothing here (every kernel reduces in a fixed order); this
mode removes the choices that change with the number of tokens:

- cuBLAS picks its GEMM/GEMV algorithm (tile, split-K) by the row count M, so one row's bits
  depend on how many rows share the call: ``aten::mm``, ``addmm`` and ``mv`` on CUDA run in
  fixed chunks of ``CHUNK_ROWS`` rows (the last one zero-padded), every chunk the same shape,
  hence the same algorithm, and a row's result depends only on its own inputs.
- torch's reduction kernels (RMSNorm's mean, AttnRes's softmax over its sources) pick their
  thread/block split by the tensor's shape: ``aten::mean.dim``, ``sum.dim_IntList`` and
  ``_softmax`` over one dim run the same way, on ``[CHUNK_ROWS, n]`` row blocks.
- The MoE kernels pick the router GEMV and the weight-streaming decode GEMMs for small batches:
  ``k3_moe_set_batch_invariant`` makes them choose by the sizes alone (ops/moe/cuda.py).
- The MLA kernels size their split-KV by the batch's token count and block-table width, and
  pick the expanded or absorbed prefill by its tokens per sequence: ``k3_mla_set_batch_invariant``
  splits every sequence's keys at fixed multiples of 256 and runs every prefill absorbed.
- KDA: each sequence's chunks and states are its own CTAs'; the walk's value-column width
  (16 or 32) and stage count follow the batch, which should not change a product's k order
  (each MMA output element sums over the same k steps) but is not proven bitwise at K3 dims
  (tests/gpu/test_determinism.py's tiny-K3 prompts run one width both ways).

``set_batch_invariant`` is the one switch (what a ``--batch-invariant`` flag calls). The overrides are
process-wide registrations on the CUDA dispatch key; turning the mode off removes them.
"""
from __future__ import annotations

import ctypes
import threading
import warnings

import torch

CHUNK_ROWS = 128  # rows per GEMM / reduction call; one cuBLAS shape per weight

_lock = threading.Lock()
_library: torch.library.Library | None = None


_ALIGN = 256  # bytes: cuBLAS picks kernels by operand alignment up to this; every block keeps it


def _row_blocks(fn, out_cols: int, out_dtype: torch.dtype, *row_tensors: torch.Tensor) -> torch.Tensor:
    """fn(*blocks, out) over 2-D tensors of the same row count in fixed blocks of CHUNK_ROWS
    rows (the last zero-padded), so every call has the same shape and operand alignment; out
    [CHUNK_ROWS, out_cols]. Whole blocks of 256-byte aligned contiguous inputs are passed as
    views (no copy); the others are copied into aligned buffers."""
    first = row_tensors[0]
    m = first.shape[0]
    out = torch.empty(m, out_cols, dtype=out_dtype, device=first.device)
    direct = (CHUNK_ROWS * out_cols * out.element_size()) % _ALIGN == 0 and all(
        t.is_contiguous() and t.data_ptr() % _ALIGN == 0 and (CHUNK_ROWS * t.stride(0) * t.element_size()) % _ALIGN == 0
        for t in row_tensors)
    blocks = block_out = None
    for start in range(0, m, CHUNK_ROWS):
        n = min(CHUNK_ROWS, m - start)
        if direct and n == CHUNK_ROWS:
            fn(*(t[start:start + n] for t in row_tensors), out[start:start + n])
            continue
        if blocks is None:
            blocks = [torch.zeros(CHUNK_ROWS, t.shape[1], dtype=t.dtype, device=t.device) for t in row_tensors]
            block_out = torch.empty(CHUNK_ROWS, out_cols, dtype=out_dtype, device=first.device)
        for blk, t in zip(blocks, row_tensors):
            blk[:n].copy_(t[start:start + n])
            if n < CHUNK_ROWS:
                blk[n:].zero_()
        fn(*blocks, block_out)
        out[start:start + n].copy_(block_out[:n])
    return out


def _mm(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return _row_blocks(lambda blk, o: torch.mm(blk, b, out=o), b.shape[1], a.dtype, a)


def _addmm(bias: torch.Tensor, a: torch.Tensor, b: torch.Tensor, *, beta=1, alpha=1) -> torch.Tensor:
    if bias.dim() == 2 and bias.shape[0] == a.shape[0] and a.shape[0] != 1:  # per-row bias: blocked too
        full = bias.expand(a.shape[0], b.shape[1])
        return _row_blocks(lambda blk, bb, o: torch.addmm(bb, blk, b, beta=beta, alpha=alpha, out=o), b.shape[1],
                           a.dtype, a, full)
    return _row_blocks(lambda blk, o: torch.addmm(bias, blk, b, beta=beta, alpha=alpha, out=o), b.shape[1],
                       a.dtype, a)


def _mv(a: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    return _row_blocks(lambda blk, o: torch.mv(blk, v, out=o.view(-1)), 1, a.dtype, a).view(-1)


def _over_last_dim(x: torch.Tensor, dim: int, fn, keep_reduced: bool, out_dtype: torch.dtype) -> torch.Tensor:
    """Applies fn(block [CHUNK_ROWS, n], out) to x with `dim` moved last and the other dims
    flattened into rows; keep_reduced: fn keeps the dim (softmax) rather than reducing it."""
    d = dim % x.dim()
    moved = x.movedim(d, -1)
    lead = moved.shape[:-1]
    rows = moved.reshape(-1, moved.shape[-1])
    cols = rows.shape[1] if keep_reduced else 1
    out = _row_blocks(lambda blk, o: fn(blk, o if keep_reduced else o.view(-1)), cols, out_dtype, rows)
    if keep_reduced:
        return out.view(*lead, cols).movedim(-1, d).contiguous()
    return out.view(lead)


def _reduction(name: str):
    op = getattr(torch, name)

    def impl(x, dim=None, keepdim=False, *, dtype=None):
        dims = [dim] if isinstance(dim, int) else list(dim or [])
        if x.dim() < 1 or len(dims) != 1:  # whole-tensor or multi-dim reductions: unchanged
            meta = op(torch.empty_like(x, device="meta"), dim, keepdim, dtype=dtype)
            return op(x, dim, keepdim, dtype=dtype, out=torch.empty_like(meta, device=x.device))
        out_dtype = dtype if dtype is not None else (x.dtype if name == "mean" or x.dtype.is_floating_point
                                                      else torch.int64)
        out = _over_last_dim(x, dims[0], lambda blk, o: op(blk, -1, dtype=dtype, out=o), False, out_dtype)
        return out.unsqueeze(dims[0] % x.dim()) if keepdim else out
    return impl


def _softmax(x: torch.Tensor, dim: int, half_to_float: bool) -> torch.Tensor:
    out_dtype = torch.float32 if half_to_float else x.dtype
    if x.dim() == 0:
        return torch._softmax(x, dim, half_to_float, out=torch.empty((), dtype=out_dtype, device=x.device))
    return _over_last_dim(x, dim, lambda blk, o: torch._softmax(blk, -1, half_to_float, out=o), True, out_dtype)


def _install(key: str) -> torch.library.Library:
    lib = torch.library.Library("aten", "IMPL")
    # torch warns once that these replace its own kernels: that is the point
    warnings.filterwarnings("ignore", message="Warning only once for all operators", category=UserWarning)
    lib.impl("mm", _mm, key)
    lib.impl("addmm", _addmm, key)
    lib.impl("mv", _mv, key)
    lib.impl("mean.dim", _reduction("mean"), key)
    lib.impl("sum.dim_IntList", _reduction("sum"), key)
    lib.impl("_softmax", _softmax, key)
    return lib


def set_batch_invariant(enabled: bool) -> None:
    """Turns the batch-invariant mode on or off for this process: the torch overrides above
    (CUDA dispatch key) and the MoE and MLA kernels' batch-independent choices. Needs the CUDA
    kernel library (RuntimeError, one line, without it); costs speed
    (bench/results/determinism_h200.json)."""
    global _library
    from .cuda_library import library_path, load_library
    if not library_path().exists():
        raise RuntimeError(f"the batch-invariant mode needs the CUDA kernel library ({library_path()} not found: "
                           "run build_scripts/build_kernels.sh or set K3_KERNELS_LIB)")
    from .moe import cuda as moe  # loads the library and registers the MoE kernels
    with _lock:
        moe.set_batch_invariant(enabled)
        lib = load_library()  # the same handle as the ops' (one process-wide mode per kernel family)
        try:
            set_mla = lib.k3_mla_set_batch_invariant
        except AttributeError:
            raise RuntimeError("the CUDA kernel library has no MLA batch-invariant mode: rebuild it with "
                               "build_scripts/build_kernels.sh") from None
        set_mla.argtypes, set_mla.restype = [ctypes.c_int], None
        set_mla(int(bool(enabled)))
        if enabled and _library is None:
            _library = _install("CUDA")
        elif not enabled and _library is not None:
            _library._destroy()
            _library = None


def batch_invariant() -> bool:
    return _library is not None
