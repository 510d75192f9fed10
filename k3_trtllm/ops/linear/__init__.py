"""The model's dense projections, ``y = x @ weight.T``: ``torch.nn.functional.linear``, except for
one-token bf16 calls on CUDA (batch-1 decode steps) of the shapes where the skinny kernel
(``cuda.py``, ``plugins/c_api/linear.cu``) measured at least as fast as cuBLAS on the H200: one
launch where cuBLAS often takes a split-K GEMM and its reduce kernel, with fp32 accumulation and
one rounding as cuBLAS's, in another summation order (tests: tests/gpu/test_linear_cuda.py).

Measured (H6, 2026-12-02, L2 flushed, one token, K3 TP8 shapes; skinny vs torch us): wide
outputs win (7168 x 1536: 11.4 vs 12.4, 7168 x 3584: 20.2 vs 23.2, 6284 x 7168: 31.4 vs 34.8,
20480 x 7168 fp32: 82 vs 85), 3584-3648 x 7168 ties (24.6 vs 23.3 + a reduce launch), and
1536 x 7168 loses (18.2 vs 14.0: too few rows for one warp each to fill the memory system), as
does every shape at 4 tokens (the kernel takes up to 4; e.g. 8448 x 7168: 60 vs 40); hence
``_skinny_wins``.

torch's linear runs everywhere else: on CPU, in fp32/fp64 models, for other token counts and
shapes, while ``torch.export`` traces (the exported graphs stay torch's), and in the
batch-invariant mode, whose fixed-shape GEMMs replace ``aten::mm`` for every token count (a
kernel taken for some calls only would make a token's bits depend on the batch)."""
from __future__ import annotations

import torch
from torch.nn import functional as F

from ..batch_invariant import batch_invariant
from . import cuda


def _skinny_wins(n: int, k: int) -> bool:
    """Whether the skinny kernel is at least as fast as cuBLAS for one token of an n x k weight:
    outputs of >= 3584 features, or short rows (see the measurements above)."""
    return n >= 3584 or k < 4096


def _skinny(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether the skinny kernel takes ``x @ weight.T`` (``cuda.why_not`` has the operand rules)."""
    # exporting first: a traced (symbolic) token count must not be compared, which would specialise it
    return (not torch.compiler.is_exporting() and x.is_cuda and x.dim() == 2 and x.shape[0] == 1
            and x.dtype == torch.bfloat16 and not batch_invariant() and weight.dim() == 2
            and _skinny_wins(weight.shape[0], x.shape[1]) and cuda.available() and cuda.why_not(x, weight) is None)


def linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """``F.linear(x, weight)`` (no bias), in the activation dtype."""
    return cuda.linear(x, weight) if _skinny(x, weight) else F.linear(x, weight)


def linear_fp32(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor | None:
    """``x @ weight.T`` accumulated and returned in fp32 by the skinny kernel (the LM head of a
    batch-1 decode step), or None where it does not take the call."""
    return cuda.linear(x, weight, out_fp32=True) if _skinny(x, weight) else None
