"""Small element-wise building blocks shared by the ops and the model (fp32 math)."""
from __future__ import annotations

import torch


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """fp32 for bf16/fp16/fp32 activations, fp64 when the caller works in fp64."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def rms_norm(x: torch.Tensor, weight: torch.Tensor | None, eps: float) -> torch.Tensor:
    """RMSNorm over the last dim: fp32 math, the weight multiplied in fp32, one rounding
    to the input dtype (spec §4.2, the fused-kernel convention)."""
    cd = compute_dtype(x.dtype)
    x32 = x.to(cd)
    y = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    if weight is not None:
        y = y * weight.to(cd)
    return y.to(x.dtype)


def situ_glu(gate: torch.Tensor, up: torch.Tensor, beta: float, linear_beta: float) -> torch.Tensor:
    """SiTU-GLU (spec §4.3): beta*tanh(g/beta)*sigmoid(g) * linear_beta*tanh(u/linear_beta);
    ``linear_beta == 0`` disables the soft clip of the up branch. fp32 math, one rounding."""
    cd = compute_dtype(gate.dtype)
    g = gate.to(cd)
    u = up.to(cd)
    gate_act = beta * torch.tanh(g / beta) * torch.sigmoid(g)
    up_act = linear_beta * torch.tanh(u / linear_beta) if linear_beta else u
    return (gate_act * up_act).to(gate.dtype)


def silu_glu(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    cd = compute_dtype(gate.dtype)
    return (torch.nn.functional.silu(gate.to(cd)) * up.to(cd)).to(gate.dtype)


def glu(gate: torch.Tensor, up: torch.Tensor, activation: int, beta: float, linear_beta: float) -> torch.Tensor:
    """activation 1 = SiTU, 0 = SiLU (the contract's integer attribute)."""
    return situ_glu(gate, up, beta, linear_beta) if activation == 1 else silu_glu(gate, up)


def gated_rms_norm(x: torch.Tensor, weight: torch.Tensor, gate: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm(x; weight) * sigmoid(gate), fp32 math and one rounding (spec §4.5.8)."""
    cd = compute_dtype(x.dtype)
    x32 = x.to(cd)
    y = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps) * weight.to(cd)
    return (y * torch.sigmoid(gate.to(cd))).to(x.dtype)
