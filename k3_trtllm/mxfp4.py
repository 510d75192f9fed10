"""MXFP4 (OCP MX, E2M1 elements + E8M0 scales, 32-element groups) in plain torch (spec §2.6).

Layout along the last (input) dimension of a weight ``[..., N]``:
``packed [..., N/2]`` uint8 holds element ``2j`` in the low nibble and ``2j+1`` in the
high nibble; ``scale [..., N/32]`` uint8 holds one E8M0 exponent per 32 elements.
"""
from __future__ import annotations

import torch

GROUP_SIZE = 32
E2M1_MAGNITUDES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
# Largest E2M1 exponent: 6 = 1.5 * 2**2 (OCP "emax_elem").
_E2M1_EMAX = 2
_E8M0_BIAS = 127
_E8M0_MIN_EXP = -127  # byte 0 is 2**-127, not zero
_E8M0_MAX_EXP = 127  # byte 254; byte 255 is NaN


def _e2m1_table() -> torch.Tensor:
    """Value of each of the 16 nibble codes (bit 3 = sign; code 8 is -0.0)."""
    mags = torch.tensor(E2M1_MAGNITUDES, dtype=torch.float32)
    return torch.cat([mags, -mags])


def _e8m0_table() -> torch.Tensor:
    """fp32 value of each scale byte. Built from exact Python powers of two: 2**-127 is an
    fp32 subnormal, every value is exact; 255 is NaN."""
    values = [2.0 ** (b - _E8M0_BIAS) for b in range(255)] + [float("nan")]
    return torch.tensor(values, dtype=torch.float32)


def check_mxfp4_pair(packed: torch.Tensor, scale: torch.Tensor,
                     packed_name: str = "packed", scale_name: str = "scale") -> int:
    """Validate a packed/scale pair and return the unpacked length N of the last dim."""
    for name, t in ((packed_name, packed), (scale_name, scale)):
        if t.dtype != torch.uint8:
            raise ValueError(f"{name}: expected dtype uint8, got {t.dtype}")
        if t.dim() < 1:
            raise ValueError(f"{name}: expected at least 1 dimension, got a scalar")
    n = 2 * packed.shape[-1]
    if n % GROUP_SIZE != 0:
        raise ValueError(
            f"{packed_name}: last dim {packed.shape[-1]} unpacks to N = {n} elements, "
            f"expected N % {GROUP_SIZE} == 0")
    expected_scale = (*packed.shape[:-1], n // GROUP_SIZE)
    if tuple(scale.shape) != expected_scale:
        raise ValueError(
            f"{scale_name}: expected shape {list(expected_scale)} to match {packed_name} "
            f"{list(packed.shape)} (one scale per {GROUP_SIZE} elements), got {list(scale.shape)}")
    return n


def dequantize_mxfp4(packed: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype = torch.bfloat16,
                     packed_name: str = "packed", scale_name: str = "scale") -> torch.Tensor:
    """``[..., N/2]`` codes and ``[..., N/32]`` scales -> ``[..., N]`` values in ``dtype``.

    The code value times the scale is formed in fp32, where it is exact (a 2-bit
    significand times a power of two), then cast once; the cast is exact in bf16 for
    scale bytes <= 252 and overflows to inf at bytes 253/254 for the largest codes.
    """
    n = check_mxfp4_pair(packed, scale, packed_name, scale_name)
    codes = torch.stack((packed & 0x0F, packed >> 4), dim=-1).reshape(*packed.shape[:-1], n)
    values = _e2m1_table().to(packed.device)[codes.long()]
    scales = _e8m0_table().to(packed.device)[scale.long()]
    values = values.view(*packed.shape[:-1], n // GROUP_SIZE, GROUP_SIZE) * scales.unsqueeze(-1)
    return values.reshape(*packed.shape[:-1], n).to(dtype)


def _round_to_e2m1_code(magnitude: torch.Tensor) -> torch.Tensor:
    """Magnitude code 0..7 of the nearest E2M1 value, ties to the even code, saturating
    at 6. Midpoint i lies between codes i and i+1: at an exact tie the value stays at
    code i when i is even and moves up when i is odd (then i+1 is even)."""
    grid = E2M1_MAGNITUDES
    code = torch.zeros_like(magnitude, dtype=torch.uint8)
    for i in range(len(grid) - 1):
        midpoint = (grid[i] + grid[i + 1]) / 2
        above = magnitude >= midpoint if i % 2 == 1 else magnitude > midpoint
        code += above.to(torch.uint8)
    return code


def quantize_mxfp4(w: torch.Tensor, name: str = "w") -> tuple[torch.Tensor, torch.Tensor]:
    """``[..., N]`` float -> (``packed [..., N/2]``, ``scale [..., N/32]``) uint8.

    OCP MX rule, per group of 32 consecutive elements of the last dim:
    scale exponent ``e = floor(log2(amax)) - 2`` (2 = E2M1's largest exponent, so
    ``amax / 2**e`` lies in [4, 8)), clamped to E8M0's [-127, 127]; an all-zero group
    gets ``e = -127`` (byte 0). Each ``w / 2**e`` is rounded to the nearest E2M1 value,
    ties to the even code, and saturated at 6 (so group maxima in (6, 8)·2**e clip to 6).
    The sign bit copies the input's sign bit, so negative values that round to zero
    give code 8 (-0) and quantize(dequantize(q)) reproduces q byte for byte.
    """
    if not w.is_floating_point():
        raise ValueError(f"{name}: expected a floating-point tensor, got {w.dtype}")
    if w.dim() < 1 or w.shape[-1] % GROUP_SIZE != 0:
        raise ValueError(f"{name}: last dim must be a multiple of {GROUP_SIZE}, got shape {list(w.shape)}")
    if not bool(torch.isfinite(w).all()):
        raise ValueError(f"{name}: contains inf or NaN, which MXFP4 quantization cannot encode")
    lead, n = w.shape[:-1], w.shape[-1]
    # fp64 makes every step below exact: the input converts exactly and scaling by a
    # power of two within [2**-127, 2**127] never rounds.
    groups = w.to(torch.float64).reshape(*lead, n // GROUP_SIZE, GROUP_SIZE)
    amax = groups.abs().amax(dim=-1)
    _, exponent = torch.frexp(amax)  # amax = m * 2**exponent with m in [0.5, 1)
    scale_exp = torch.where(amax > 0, exponent.to(torch.int64) - 1 - _E2M1_EMAX,
                            torch.full_like(exponent, _E8M0_MIN_EXP, dtype=torch.int64))
    scale_exp = scale_exp.clamp(_E8M0_MIN_EXP, _E8M0_MAX_EXP)
    inverse_scales = torch.tensor([2.0 ** -e for e in range(_E8M0_MIN_EXP, _E8M0_MAX_EXP + 1)],
                                  dtype=torch.float64, device=w.device)
    scaled = groups * inverse_scales[scale_exp - _E8M0_MIN_EXP].unsqueeze(-1)
    code = _round_to_e2m1_code(scaled.abs()) | (torch.signbit(scaled).to(torch.uint8) << 3)
    code = code.reshape(*lead, n // 2, 2)
    packed = code[..., 0] | (code[..., 1] << 4)
    scale = (scale_exp + _E8M0_BIAS).to(torch.uint8)
    return packed.contiguous(), scale
