"""Reference implementations of ``k3::mla_prefill`` and ``k3::mla_decode`` (contract.py), and
of their ``_fp8`` twins over the fp8 latent cache (fp8_cache.py).

Both insert this step's latent rows into the paged cache, then let every new token
attend causally to its sequence's cached positions. Prefill uses the expanded form,
decode the absorbed one; both accept any number of new tokens per sequence, so either
can serve any step and the two can be compared. Math in fp32 (fp64 for fp64 inputs),
output and cache in the activation dtype.
"""
from __future__ import annotations

from typing import Callable

import torch

from .. import registry
from ..common import compute_dtype
from ..contract import MLA_DECODE, MLA_DECODE_FP8, MLA_PREFILL, MLA_PREFILL_FP8
from . import fp8_cache
from .naive import absorbed_attention, expanded_attention, gather_latents, insert_latents


def _validate(contract, q, latent, w_uk, w_uv, cu_seqlens, context_lens, block_tables, slot_mapping,
              latent_cache, *attrs) -> dict[str, int]:
    """The contract's checks, then the values: offsets, context lengths, slots, block ids."""
    dims = contract.check(q, latent, w_uk, w_uv, cu_seqlens, context_lens, block_tables, slot_mapping,
                          latent_cache, *attrs)
    num_tokens = dims["T"]

    # The messages that list tensor values are only built on failure.
    new_tokens = cu_seqlens[1:] - cu_seqlens[:-1]
    if int(cu_seqlens[0]) != 0 or int(cu_seqlens[-1]) != num_tokens or bool((new_tokens < 0).any()):
        raise ValueError(f"cu_seqlens: expected non-decreasing offsets from 0 to T={num_tokens}, "
                         f"got {cu_seqlens.tolist()}")
    if bool((context_lens < 0).any()):
        raise ValueError(f"context_lens: expected >= 0, got {context_lens.tolist()}")

    num_blocks, block_size = dims["num_blocks"], dims["block_size"]
    if bool(((slot_mapping < 0) | (slot_mapping >= num_blocks * block_size)).any()):
        raise ValueError(f"slot_mapping: expected slots in [0, {num_blocks * block_size}), "
                         f"got {slot_mapping.tolist()}")
    if torch.unique(slot_mapping).numel() != num_tokens:
        raise ValueError("slot_mapping: two tokens of one step write the same slot")

    blocks_needed = (context_lens.long() + new_tokens + block_size - 1) // block_size
    max_blocks = dims["max_blocks"]
    if bool((blocks_needed > max_blocks).any()):
        raise ValueError(f"block_tables: {max_blocks} blocks per row cannot hold context_lens + new tokens "
                         f"(needs {blocks_needed.tolist()} blocks of {block_size})")
    used = torch.arange(max_blocks, device=block_tables.device)[None, :] < blocks_needed[:, None]
    in_range = (block_tables >= 0) & (block_tables < num_blocks)
    if not bool((in_range | ~used).all()):
        raise ValueError(f"block_tables: expected block ids in [0, {num_blocks}) for every used entry")
    return dims


AttentionFn = Callable[..., torch.Tensor]


def _paged_attention(contract, attention: AttentionFn, q, latent, w_uk, w_uv, cu_seqlens, context_lens,
                     block_tables, slot_mapping, latent_cache, num_heads, qk_nope_head_dim,
                     qk_rope_head_dim, kv_lora_rank, v_head_dim, softmax_scale, *scale_group) -> torch.Tensor:
    """``scale_group`` (one value) is given for the fp8 cache: rows are then quantised on
    insert and dequantised on gather (fp8_cache.py), the attention itself unchanged."""
    dims = _validate(contract, q, latent, w_uk, w_uv, cu_seqlens, context_lens, block_tables, slot_mapping,
                     latent_cache, num_heads, qk_nope_head_dim, qk_rope_head_dim, kv_lora_rank, v_head_dim,
                     softmax_scale, *scale_group)
    if scale_group and not (scale_group[0] % 16 == 0 and kv_lora_rank % scale_group[0] == 0):
        raise ValueError(f"{contract.qualified_name}: scale_group {scale_group[0]}: expected a multiple of 16 "
                         f"dividing kv_lora_rank {kv_lora_rank} (the contract's rule, which the kernels need)")
    if scale_group:
        insert_latents(latent_cache, fp8_cache.quantize(latent, kv_lora_rank, *scale_group), slot_mapping)
    else:
        insert_latents(latent_cache, latent, slot_mapping)

    cd = compute_dtype(q.dtype)
    w_uk_c, w_uv_c = w_uk.to(cd), w_uv.to(cd)
    out = q.new_empty((dims["T"], dims["H"] * dims["Dv"]))
    bounds, contexts = cu_seqlens.tolist(), context_lens.tolist()
    for b, context_len in enumerate(contexts):
        start, end = bounds[b], bounds[b + 1]
        if start == end:
            continue
        latents = gather_latents(latent_cache, block_tables[b], context_len + end - start)
        if scale_group:
            latents = fp8_cache.dequantize(latents, kv_lora_rank, qk_rope_head_dim, *scale_group)
        latents = latents.to(cd)
        seq_out = attention(q[start:end].to(cd), latents, w_uk_c, w_uv_c, context_len, softmax_scale)
        out[start:end] = seq_out.reshape(end - start, -1).to(q.dtype)
    return out


def mla_prefill(*args) -> torch.Tensor:
    return _paged_attention(MLA_PREFILL, expanded_attention, *args)


def mla_decode(*args) -> torch.Tensor:
    return _paged_attention(MLA_DECODE, absorbed_attention, *args)


def mla_prefill_fp8(*args) -> torch.Tensor:
    return _paged_attention(MLA_PREFILL_FP8, expanded_attention, *args)


def mla_decode_fp8(*args) -> torch.Tensor:
    return _paged_attention(MLA_DECODE_FP8, absorbed_attention, *args)


def mla_fake(q, latent, w_uk, w_uv, cu_seqlens, context_lens, block_tables, slot_mapping,
             latent_cache, num_heads, qk_nope_head_dim, qk_rope_head_dim, kv_lora_rank,
             v_head_dim, softmax_scale, *scale_group) -> tuple[torch.Tensor]:
    return (q.new_empty((q.shape[0], num_heads * v_head_dim)),)


registry.register(MLA_PREFILL, mla_prefill, mla_fake)
registry.register(MLA_DECODE, mla_decode, mla_fake)
registry.register(MLA_PREFILL_FP8, mla_prefill_fp8, mla_fake)
registry.register(MLA_DECODE_FP8, mla_decode_fp8, mla_fake)
