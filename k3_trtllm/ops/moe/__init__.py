"""Routed latent MoE (spec §4.6) and MXFP4 expert weights (spec §2.6).

Importing this package registers ``torch.ops.k3.situ_moe`` and ``torch.ops.k3.situ_moe_mxfp4``.
"""
from . import reference
from ...mxfp4 import check_mxfp4_pair, dequantize_mxfp4, quantize_mxfp4
from .naive import grouping_applies, route, routed_experts

__all__ = ["reference", "check_mxfp4_pair", "dequantize_mxfp4", "quantize_mxfp4", "grouping_applies", "route",
           "routed_experts"]
