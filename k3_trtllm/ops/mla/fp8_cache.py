"""The fp8 latent cache row (``--kv-cache-dtype fp8``; contract ``mla_*_fp8``).

One row of ``row_bytes(R, Dr, Q)`` bytes per cached token, all offsets 16-byte aligned for
K3 (R 512, Q 128, Dr 64: 656 bytes against 1152 for a bf16 row):

====================  ==============  ==================================================
bytes                 what            how
====================  ==============  ==================================================
``[0, R)``            latent codes    E4M3 (OCP fp8, bias 7, max 448) of ``c / s_g``
``[R, R + 4R/Q)``     scales          fp32, little endian, ``s_g = amax_g / 448`` for
                                      group ``g`` = channels ``[gQ, gQ+Q)`` (1.0 if 0)
``[R + 4R/Q, +2Dr)``  rope            bf16 of ``k_pe`` (round to nearest even)
====================  ==============  ==================================================

Codes are ``satfinite_rne_e4m3(c / s_g)`` with an IEEE fp32 division, so a CUDA writer
(``__fdiv_rn`` then ``__nv_cvt_float_to_fp8(.., __NV_SATFINITE, __NV_E4M3)``) produces the
same bytes as this module. The rope stays bf16 because it is 64 of 576 channels and carries
the position: quantising it would cost accuracy for 10% of the bytes.
"""
from __future__ import annotations

import torch

E4M3_MAX = 448.0


def scale_group_for(kv_lora_rank: int) -> int:
    """Channels per scale: 128 (K3) when it divides the rank, else the largest multiple of
    16 up to 128 that does (the tiny model's rank 64 gets 64)."""
    for q in range(128, 15, -16):
        if kv_lora_rank % q == 0:
            return q
    raise ValueError(f"kv_lora_rank {kv_lora_rank}: the fp8 latent cache needs a multiple of 16")


def row_bytes(kv_lora_rank: int, rope_dim: int, scale_group: int) -> int:
    return kv_lora_rank + 4 * (kv_lora_rank // scale_group) + 2 * rope_dim


def quantize(latent: torch.Tensor, kv_lora_rank: int, scale_group: int) -> torch.Tensor:
    """``[..., R+Dr]`` float rows -> ``[..., row_bytes]`` uint8 rows (layout above)."""
    lead = latent.shape[:-1]
    x = latent.float()
    c, rope = x[..., :kv_lora_rank], x[..., kv_lora_rank:]
    groups = c.reshape(*lead, kv_lora_rank // scale_group, scale_group)
    amax = groups.abs().amax(-1, keepdim=True)
    # the divisor is a tensor on purpose: torch on CUDA turns division by a Python scalar into
    # a product with its fp32 reciprocal (one bit off in about half the cases), which would
    # make the bytes depend on the device; this is the IEEE division everywhere
    scale = torch.where(amax > 0, amax / torch.full_like(amax, E4M3_MAX), torch.ones_like(amax))
    codes = (groups / scale).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn)
    return torch.cat((codes.reshape(*lead, kv_lora_rank).view(torch.uint8),
                      scale.reshape(*lead, -1).contiguous().view(torch.uint8),
                      rope.to(torch.bfloat16).contiguous().view(torch.uint8)), -1)


def dequantize(rows: torch.Tensor, kv_lora_rank: int, rope_dim: int, scale_group: int,
               dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """``[..., row_bytes]`` uint8 rows -> ``[..., R+Dr]`` rows in ``dtype``: code * scale in fp32."""
    lead, g = rows.shape[:-1], kv_lora_rank // scale_group
    codes = rows[..., :kv_lora_rank].contiguous().view(torch.float8_e4m3fn).float()
    scale = rows[..., kv_lora_rank:kv_lora_rank + 4 * g].contiguous().view(torch.float32)
    rope = rows[..., kv_lora_rank + 4 * g:].contiguous().view(torch.bfloat16).float()
    c = (codes.reshape(*lead, g, scale_group) * scale.unsqueeze(-1)).reshape(*lead, kv_lora_rank)
    return torch.cat((c, rope), -1).to(dtype)
