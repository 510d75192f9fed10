"""Readable MLA math (spec §4.4, §6.1) in whatever float dtype the inputs have.

Shapes for one sequence: ``q [n, H, Dn+Dr]`` are its n new tokens, ``latents
[L, R+Dr]`` (L = context_len + n) are the cached rows ``[ĉ_kv | k_pe]`` of all its
positions, ``w_uk [H, Dn, R]`` and ``w_uv [H, Dv, R]`` are the per-head rows of
kv_b_proj. New token i sits at absolute position ``context_len + i`` and sees keys
0..context_len+i. Both attention forms return ``[n, H, Dv]``.
"""
from __future__ import annotations

import torch


def insert_latents(latent_cache: torch.Tensor, latent: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """Write row t of ``latent`` at flat slot ``slot_mapping[t]`` = block*block_size+offset."""
    block_size = latent_cache.shape[1]
    slots = slot_mapping.long()
    latent_cache[slots // block_size, slots % block_size] = latent.to(latent_cache.dtype)


def gather_latents(latent_cache: torch.Tensor, block_table_row: torch.Tensor, length: int) -> torch.Tensor:
    """Rows of positions 0..length-1 of one sequence: position p lives in block
    ``block_table_row[p // block_size]`` at offset ``p % block_size``."""
    block_size = latent_cache.shape[1]
    positions = torch.arange(length, device=latent_cache.device)
    blocks = block_table_row.to(latent_cache.device).long()[positions // block_size]
    return latent_cache[blocks, positions % block_size]


def causal_mask(num_new: int, context_len: int, device: torch.device | None = None) -> torch.Tensor:
    """``[n, context_len+n]`` bool, True where new token i may attend to key position j."""
    query_pos = context_len + torch.arange(num_new, device=device)
    key_pos = torch.arange(context_len + num_new, device=device)
    return key_pos[None, :] <= query_pos[:, None]


def _softmax_over_keys(scores: torch.Tensor, context_len: int) -> torch.Tensor:
    """scores ``[H, n, L]`` -> probabilities with the causal mask applied."""
    mask = causal_mask(scores.shape[1], context_len, scores.device)
    return torch.softmax(scores.masked_fill(~mask, float("-inf")), dim=-1)


def expanded_attention(
    q: torch.Tensor,
    latents: torch.Tensor,
    w_uk: torch.Tensor,
    w_uv: torch.Tensor,
    context_len: int,
    scale: float,
) -> torch.Tensor:
    """Non-absorbed (prefill) form, §4.4.3: every key position gets per-head
    ``k_nope = W_UK,h ĉ_kv`` and ``v = W_UV,h ĉ_kv``; k_pe is shared by all heads."""
    rank, nope_dim = w_uk.shape[2], w_uk.shape[1]
    c_kv, k_pe = latents[:, :rank], latents[:, rank:]
    q_nope, q_pe = q[..., :nope_dim], q[..., nope_dim:]
    k_nope = torch.einsum("hdr,jr->jhd", w_uk, c_kv)
    v = torch.einsum("hdr,jr->jhd", w_uv, c_kv)
    scores = torch.einsum("ihd,jhd->hij", q_nope, k_nope) + torch.einsum("ihd,jd->hij", q_pe, k_pe)
    probs = _softmax_over_keys(scores * scale, context_len)
    return torch.einsum("hij,jhd->ihd", probs, v)


def absorbed_attention(
    q: torch.Tensor,
    latents: torch.Tensor,
    w_uk: torch.Tensor,
    w_uv: torch.Tensor,
    context_len: int,
    scale: float,
) -> torch.Tensor:
    """Absorbed (decode) form, §4.4.5: MQA over the latent rows with one shared
    R+Dr wide key/value head; W_UK moves to the query, W_UV to the output."""
    rank, nope_dim = w_uk.shape[2], w_uk.shape[1]
    c_kv, k_pe = latents[:, :rank], latents[:, rank:]
    q_nope, q_pe = q[..., :nope_dim], q[..., nope_dim:]
    q_latent = torch.einsum("ihd,hdr->ihr", q_nope, w_uk)
    scores = torch.einsum("ihr,jr->hij", q_latent, c_kv) + torch.einsum("ihd,jd->hij", q_pe, k_pe)
    probs = _softmax_over_keys(scores * scale, context_len)
    out_latent = torch.einsum("hij,jr->ihr", probs, c_kv)
    return torch.einsum("ihr,hvr->ihv", out_latent, w_uv)
