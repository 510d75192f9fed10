"""The residual stream's element-wise ops: RMSNorm, the KDA output's gated RMSNorm, the AttnRes mix
fused with its residual add and norm, the MLP's gated activation and the MLA output gate.

Each function runs its CUDA kernel (``cuda.py``, ``plugins/c_api/norm.cu``) on bf16 CUDA tensors
when the kernel library is built, and its reference (``reference.py``, ``..common``) otherwise:
on CPU, in fp32/fp64 models, and always while ``torch.export`` traces, so the exported graphs
are the reference's. Kernel and reference agree to one bf16 rounding of the output
(tests/gpu/test_norm_cuda.py)."""
from __future__ import annotations

import warnings

import torch

from .. import common
from . import cuda, reference
from .reference import partial_sum  # noqa: F401  (the model's P + a where no mix follows)

_available: bool | None = None


def _kernels(x: torch.Tensor) -> bool:
    global _available
    if not x.is_cuda or x.dtype != torch.bfloat16 or torch.compiler.is_exporting():
        return False
    if _available is None:
        try:
            cuda._library()
            _available = True
        except FileNotFoundError:
            _available = False
        except AttributeError:  # a library built before these kernels existed
            warnings.warn("the CUDA kernel library has no norm kernels (k3_rms_norm): rebuild it with "
                          "build_scripts/build_kernels.sh; RMSNorm and the AttnRes mixes run as torch code",
                          RuntimeWarning, stacklevel=3)
            _available = False
    return _available


def rms_norm(x: torch.Tensor, weight: torch.Tensor | None, eps: float) -> torch.Tensor:
    return cuda.rms_norm(x, weight, eps) if _kernels(x) else common.rms_norm(x, weight, eps)


def gated_rms_norm(x: torch.Tensor, weight: torch.Tensor, gate: torch.Tensor, eps: float) -> torch.Tensor:
    return cuda.gated_rms_norm(x, weight, gate, eps) if _kernels(x) else common.gated_rms_norm(x, weight, gate, eps)


def glu(gate: torch.Tensor, up: torch.Tensor, activation: int, beta: float, linear_beta: float) -> torch.Tensor:
    impl = cuda.glu if _kernels(gate) else common.glu
    return impl(gate, up, activation, beta, linear_beta)


def sigmoid_gate(x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
    return cuda.sigmoid_gate(x, gate) if _kernels(x) else reference.sigmoid_gate(x, gate)


# A sub-layer's output as the mixes take it (reference.Residual): one tensor, or the terms it is
# the sum of (the latent MoE's routed and shared experts), which the kernel adds on its way in.
Residual = reference.Residual


def attn_res_mix_norm(sources: list[torch.Tensor], residual: Residual, query: torch.Tensor, eps: float,
                      norm_weight: torch.Tensor, norm_eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    impl = cuda.attn_res_mix_norm if _kernels(sources[-1]) else reference.attn_res_mix_norm
    return impl(sources, residual, query, eps, norm_weight, norm_eps)


def attn_res_final_norm(sources: list[torch.Tensor], residual: Residual, query: torch.Tensor, eps: float,
                        rows: torch.Tensor, norm_weight: torch.Tensor, norm_eps: float) -> torch.Tensor:
    impl = cuda.attn_res_final_norm if _kernels(sources[-1]) else reference.attn_res_final_norm
    return impl(sources, residual, query, eps, rows, norm_weight, norm_eps)
