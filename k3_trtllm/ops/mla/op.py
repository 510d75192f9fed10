"""Reference implementations of ``k3::mla_prefill`` and ``k3::mla_decode`` (contract.py).

Both insert this step's latent rows into the paged cache, then let every new token
attend causally to its sequence's cached positions. Prefill uses the expanded form,
decode the absorbed one; both accept any number of new tokens per sequence, so either
can serve any step and the two can be compared. Math in fp32 (fp64 for fp64 inputs),
output in q's dtype, the cache in its own dtype.
"""
from __future__ import annotations

from typing import Callable

import torch

from .. import registry
from ..common import compute_dtype
from ..contract import MLA_DECODE, MLA_PREFILL
from .naive import absorbed_attention, expanded_attention, gather_latents, insert_latents


def _expect(ok: bool, message: str) -> None:
    if not ok:
        raise ValueError(message)


def _expect_shape(t: torch.Tensor, name: str, shape: tuple[int, ...]) -> None:
    _expect(tuple(t.shape) == shape, f"{name}: expected shape {shape}, got {tuple(t.shape)}")


def _validate(q, latent, w_uk, w_uv, cu_seqlens, context_lens, block_tables, slot_mapping,
              latent_cache, heads, nope_dim, rope_dim, rank, v_dim) -> None:
    for name, t in (("q", q), ("latent", latent), ("w_uk", w_uk), ("w_uv", w_uv), ("latent_cache", latent_cache)):
        _expect(t.is_floating_point(), f"{name}: expected a float tensor, got {t.dtype}")
    for name, t in (("cu_seqlens", cu_seqlens), ("context_lens", context_lens),
                    ("block_tables", block_tables), ("slot_mapping", slot_mapping)):
        _expect(t.dtype == torch.int32, f"{name}: expected int32, got {t.dtype}")

    _expect(q.dim() == 3, f"q: expected [T, num_heads, qk_nope+qk_rope], got {tuple(q.shape)}")
    num_tokens = q.shape[0]
    _expect_shape(q, "q", (num_tokens, heads, nope_dim + rope_dim))
    _expect_shape(latent, "latent", (num_tokens, rank + rope_dim))
    _expect_shape(w_uk, "w_uk", (heads, nope_dim, rank))
    _expect_shape(w_uv, "w_uv", (heads, v_dim, rank))
    _expect(latent_cache.dim() == 3 and latent_cache.shape[2] == rank + rope_dim,
            f"latent_cache: expected [num_blocks, block_size, {rank + rope_dim}], got {tuple(latent_cache.shape)}")
    _expect(cu_seqlens.dim() == 1 and cu_seqlens.shape[0] >= 1,
            f"cu_seqlens: expected [B+1], got {tuple(cu_seqlens.shape)}")
    num_seqs = cu_seqlens.shape[0] - 1
    _expect_shape(context_lens, "context_lens", (num_seqs,))
    _expect(block_tables.dim() == 2 and block_tables.shape[0] == num_seqs,
            f"block_tables: expected [{num_seqs}, max_blocks], got {tuple(block_tables.shape)}")
    _expect_shape(slot_mapping, "slot_mapping", (num_tokens,))

    # The messages that list tensor values are only built on failure.
    new_tokens = cu_seqlens[1:] - cu_seqlens[:-1]
    if int(cu_seqlens[0]) != 0 or int(cu_seqlens[-1]) != num_tokens or bool((new_tokens < 0).any()):
        raise ValueError(f"cu_seqlens: expected non-decreasing offsets from 0 to T={num_tokens}, "
                         f"got {cu_seqlens.tolist()}")
    if bool((context_lens < 0).any()):
        raise ValueError(f"context_lens: expected >= 0, got {context_lens.tolist()}")

    num_blocks, block_size = latent_cache.shape[0], latent_cache.shape[1]
    if bool(((slot_mapping < 0) | (slot_mapping >= num_blocks * block_size)).any()):
        raise ValueError(f"slot_mapping: expected slots in [0, {num_blocks * block_size}), "
                         f"got {slot_mapping.tolist()}")
    _expect(torch.unique(slot_mapping).numel() == num_tokens,
            "slot_mapping: two tokens of one step write the same slot")

    blocks_needed = (context_lens.long() + new_tokens + block_size - 1) // block_size
    max_blocks = block_tables.shape[1]
    if bool((blocks_needed > max_blocks).any()):
        raise ValueError(f"block_tables: {max_blocks} blocks per row cannot hold context_lens + new tokens "
                         f"(needs {blocks_needed.tolist()} blocks of {block_size})")
    used = torch.arange(max_blocks, device=block_tables.device)[None, :] < blocks_needed[:, None]
    in_range = (block_tables >= 0) & (block_tables < num_blocks)
    _expect(bool((in_range | ~used).all()),
            f"block_tables: expected block ids in [0, {num_blocks}) for every used entry")


AttentionFn = Callable[..., torch.Tensor]


def _paged_attention(attention: AttentionFn, q, latent, w_uk, w_uv, cu_seqlens, context_lens,
                     block_tables, slot_mapping, latent_cache, num_heads, qk_nope_head_dim,
                     qk_rope_head_dim, kv_lora_rank, v_head_dim, softmax_scale) -> torch.Tensor:
    _validate(q, latent, w_uk, w_uv, cu_seqlens, context_lens, block_tables, slot_mapping,
              latent_cache, num_heads, qk_nope_head_dim, qk_rope_head_dim, kv_lora_rank, v_head_dim)
    insert_latents(latent_cache, latent, slot_mapping)

    cd = compute_dtype(q.dtype)
    w_uk_c, w_uv_c = w_uk.to(cd), w_uv.to(cd)
    out = q.new_empty((q.shape[0], num_heads * v_head_dim))
    bounds, contexts = cu_seqlens.tolist(), context_lens.tolist()
    for b, context_len in enumerate(contexts):
        start, end = bounds[b], bounds[b + 1]
        if start == end:
            continue
        latents = gather_latents(latent_cache, block_tables[b], context_len + end - start).to(cd)
        seq_out = attention(q[start:end].to(cd), latents, w_uk_c, w_uv_c, context_len, softmax_scale)
        out[start:end] = seq_out.reshape(end - start, -1).to(q.dtype)
    return out


def mla_prefill(*args) -> torch.Tensor:
    return _paged_attention(expanded_attention, *args)


def mla_decode(*args) -> torch.Tensor:
    return _paged_attention(absorbed_attention, *args)


def mla_fake(q, latent, w_uk, w_uv, cu_seqlens, context_lens, block_tables, slot_mapping,
             latent_cache, num_heads, qk_nope_head_dim, qk_rope_head_dim, kv_lora_rank,
             v_head_dim, softmax_scale) -> tuple[torch.Tensor]:
    return (q.new_empty((q.shape[0], num_heads * v_head_dim)),)


registry.register(MLA_PREFILL, mla_prefill, mla_fake)
registry.register(MLA_DECODE, mla_decode, mla_fake)
