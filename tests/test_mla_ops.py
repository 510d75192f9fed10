"""MLA reference ops: absorbed vs expanded form, vs torch SDPA, chunked prefill vs one
step vs token-by-token decode, paging invariants, cache contents, input validation.

Every cache starts filled with NaN and only the rows a test writes are real, so any
read of a slot that does not belong to the sequence (another sequence's block, the
unused tail of a block, a padding entry of a block table) turns the output into NaN.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import pytest
import torch
import torch.nn.functional as F
from torch._subclasses.fake_tensor import FakeTensorMode

from k3_trtllm.ops import mla
from k3_trtllm.ops.contract import MLA_PREFILL
from k3_trtllm.model.step import build_step

BLOCK_SIZE = 16
PREFILL = torch.ops.k3.mla_prefill
DECODE = torch.ops.k3.mla_decode

# Tolerances on outputs of magnitude ~1. fp64: the forms differ only in summation order
# (~1e-15 relative). fp32: sums of up to R=512 products and the softmax give ~1e-6;
# 5e-5 leaves margin while any wrong term (mask, head, channel split) is O(1e-1).
# bf16: the outputs are rounded once to bf16, so the forms may differ by one bf16 ulp.
TOL = {
    torch.float64: dict(rtol=1e-10, atol=1e-10),
    torch.float32: dict(rtol=5e-5, atol=5e-5),
    torch.bfloat16: dict(rtol=1.6e-2, atol=1.6e-2),
}


@dataclass(frozen=True)
class Dims:
    heads: int
    nope: int
    rope: int
    rank: int
    v: int

    @property
    def width(self) -> int:
        return self.rank + self.rope

    @property
    def scale(self) -> float:
        return (self.nope + self.rope) ** -0.5

    def attrs(self) -> tuple:
        return (self.heads, self.nope, self.rope, self.rank, self.v, self.scale)


TINY = Dims(heads=4, nope=32, rope=16, rank=64, v=32)
K3 = Dims(heads=2, nope=128, rope=64, rank=512, v=128)  # K3 kernel shapes, 2 heads


@dataclass
class Sequence:
    """A sequence's whole history: latent rows and queries of every position."""
    latents: torch.Tensor  # [L, R+Dr]
    q: torch.Tensor  # [L, H, Dn+Dr]
    table: list[int]


@dataclass
class Weights:
    w_uk: torch.Tensor
    w_uv: torch.Tensor
    dims: Dims


def make_weights(dims: Dims, dtype: torch.dtype, gen: torch.Generator) -> Weights:
    # 1/sqrt(R) keeps the expanded keys and values O(1), so scores stay O(1).
    w_uk = torch.randn(dims.heads, dims.nope, dims.rank, generator=gen, dtype=torch.float64) / math.sqrt(dims.rank)
    w_uv = torch.randn(dims.heads, dims.v, dims.rank, generator=gen, dtype=torch.float64) / math.sqrt(dims.rank)
    return Weights(w_uk.to(dtype), w_uv.to(dtype), dims)


def make_sequences(dims: Dims, lengths: list[int], dtype: torch.dtype, gen: torch.Generator,
                   tables: list[list[int]]) -> list[Sequence]:
    seqs = []
    for length, table in zip(lengths, tables):
        latents = torch.randn(length, dims.width, generator=gen, dtype=torch.float64)
        q = torch.randn(length, dims.heads, dims.nope + dims.rope, generator=gen, dtype=torch.float64)
        seqs.append(Sequence(latents.to(dtype), q.to(dtype), table))
    return seqs


def blocks_for(length: int) -> int:
    return -(-length // BLOCK_SIZE)


def shuffled_tables(lengths: list[int], num_blocks: int, seed: int) -> list[list[int]]:
    """Disjoint, non-contiguous block lists drawn from 1..num_blocks-1; block 0 stays
    unused because build_step pads block tables with 0."""
    perm = (torch.randperm(num_blocks - 1, generator=torch.Generator().manual_seed(seed)) + 1).tolist()
    tables, used = [], 0
    for length in lengths:
        tables.append(perm[used:used + blocks_for(length)])
        used += blocks_for(length)
    assert used <= num_blocks - 1
    return tables


def contiguous_tables(lengths: list[int]) -> list[list[int]]:
    tables, next_block = [], 1
    for length in lengths:
        tables.append(list(range(next_block, next_block + blocks_for(length))))
        next_block += blocks_for(length)
    return tables


def nan_cache(num_blocks: int, dims: Dims, dtype: torch.dtype) -> torch.Tensor:
    return torch.full((num_blocks, BLOCK_SIZE, dims.width), float("nan"), dtype=dtype)


def preload(cache: torch.Tensor, seq: Sequence, context_len: int) -> None:
    """Write positions 0..context_len-1 by hand, independently of the op's insert."""
    for p in range(context_len):
        cache[seq.table[p // BLOCK_SIZE], p % BLOCK_SIZE] = seq.latents[p]


def run_step(op, weights: Weights, cache: torch.Tensor, pieces: list[tuple[Sequence, int, int]]) -> torch.Tensor:
    """One step with positions start..end-1 of each listed sequence as new tokens."""
    step = build_step([([0] * (end - start), start, 0, seq.table) for seq, start, end in pieces], BLOCK_SIZE)
    q = torch.cat([seq.q[start:end] for seq, start, end in pieces])
    latent = torch.cat([seq.latents[start:end] for seq, start, end in pieces])
    return op(q, latent, weights.w_uk, weights.w_uv, step.cu_seqlens, step.context_lens,
              step.block_tables, step.slot_mapping, cache, *weights.dims.attrs())


def mixed_batch(dims: Dims, dtype: torch.dtype, seed: int, spans: list[tuple[int, int]]):
    """Sequences with (context_len, end) spans, their context preloaded into a NaN cache."""
    gen = torch.Generator().manual_seed(seed)
    lengths = [end for _, end in spans]
    num_blocks = sum(blocks_for(n) for n in lengths) + 4
    seqs = make_sequences(dims, lengths, dtype, gen, shuffled_tables(lengths, num_blocks, seed))
    weights = make_weights(dims, dtype, gen)
    cache = nan_cache(num_blocks, dims, dtype)
    for seq, (context_len, _) in zip(seqs, spans):
        preload(cache, seq, context_len)
    pieces = [(seq, context_len, end) for seq, (context_len, end) in zip(seqs, spans)]
    return weights, cache, pieces


# Fresh prompts, a one-token decode after a block boundary, a chunk starting mid-block,
# a chunk starting exactly at a block boundary.
SPANS = [(0, 20), (37, 38), (5, 18), (16, 32)]


@pytest.mark.parametrize("dims,dtype,spans", [
    (TINY, torch.float64, SPANS),
    (TINY, torch.float32, SPANS),
    (TINY, torch.bfloat16, SPANS),
    (K3, torch.float32, [(0, 24), (40, 41), (7, 20)]),
])
def test_absorbed_equals_expanded(dims, dtype, spans):
    weights, cache, pieces = mixed_batch(dims, dtype, seed=1, spans=spans)
    cache_decode = cache.clone()
    out_prefill = run_step(PREFILL, weights, cache, pieces)
    out_decode = run_step(DECODE, weights, cache_decode, pieces)
    assert out_prefill.dtype == dtype and out_prefill.shape == (sum(e - s for _, s, e in pieces), dims.heads * dims.v)
    assert torch.isfinite(out_prefill).all() and torch.isfinite(out_decode).all()
    torch.testing.assert_close(out_decode, out_prefill, **TOL[dtype])
    torch.testing.assert_close(cache_decode, cache, rtol=0, atol=0, equal_nan=True)


def sdpa_reference(weights: Weights, pieces: list[tuple[Sequence, int, int]]) -> torch.Tensor:
    """Per head, explicit K = [W_UK,h c | k_pe] and V = W_UV,h c from the sequence
    history (no cache involved), attended with torch SDPA and a causal+offset mask."""
    d = weights.dims
    outs = []
    for seq, context_len, end in pieces:
        c_kv, k_pe = seq.latents[:end, :d.rank], seq.latents[:end, d.rank:]
        keys = torch.stack([torch.cat([c_kv @ weights.w_uk[h].T, k_pe], dim=-1) for h in range(d.heads)])
        values = torch.stack([c_kv @ weights.w_uv[h].T for h in range(d.heads)])
        queries = seq.q[context_len:end].transpose(0, 1)  # [H, n, Dn+Dr]
        visible = torch.arange(end)[None, :] <= torch.arange(context_len, end)[:, None]
        attn = F.scaled_dot_product_attention(queries, keys, values, attn_mask=visible, scale=d.scale)
        outs.append(attn.transpose(0, 1).reshape(end - context_len, d.heads * d.v))
    return torch.cat(outs)


@pytest.mark.parametrize("op", [PREFILL, DECODE], ids=["prefill", "decode"])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_matches_sdpa_on_expanded_heads(op, dtype):
    weights, cache, pieces = mixed_batch(TINY, dtype, seed=2, spans=SPANS)
    out = run_step(op, weights, cache, pieces)
    torch.testing.assert_close(out, sdpa_reference(weights, pieces), **TOL[dtype])


def test_expanded_attention_matches_sdpa_single_sequence():
    """The naive function itself, on plain latents (no paging), fp64."""
    gen = torch.Generator().manual_seed(3)
    weights = make_weights(TINY, torch.float64, gen)
    (seq,) = make_sequences(TINY, [29], torch.float64, gen, [[]])
    out = mla.expanded_attention(seq.q[11:], seq.latents, weights.w_uk, weights.w_uv, 11, TINY.scale)
    torch.testing.assert_close(out.reshape(18, -1), sdpa_reference(weights, [(seq, 11, 29)]), **TOL[torch.float64])


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_chunked_prefill_and_decode_match_one_prefill(dtype):
    gen = torch.Generator().manual_seed(4)
    lengths = [45, 30]
    num_blocks = sum(blocks_for(n) for n in lengths) + 3
    seqs = make_sequences(TINY, lengths, dtype, gen, shuffled_tables(lengths, num_blocks, seed=4))
    weights = make_weights(TINY, dtype, gen)
    a, b = seqs

    cache_full = nan_cache(num_blocks, TINY, dtype)
    full = run_step(PREFILL, weights, cache_full, [(a, 0, 45), (b, 0, 30)])
    full_a, full_b = full[:45], full[45:]

    # Two chunks; the second continues both sequences from a context mid-block.
    cache_chunked = nan_cache(num_blocks, TINY, dtype)
    first = run_step(PREFILL, weights, cache_chunked, [(a, 0, 20), (b, 0, 12)])
    second = run_step(PREFILL, weights, cache_chunked, [(a, 20, 45), (b, 12, 30)])
    torch.testing.assert_close(first, torch.cat([full_a[:20], full_b[:12]]), **TOL[dtype])
    torch.testing.assert_close(second, torch.cat([full_a[20:], full_b[12:]]), **TOL[dtype])
    torch.testing.assert_close(cache_chunked, cache_full, rtol=0, atol=0, equal_nan=True)

    # Token by token with the absorbed form: both sequences while b lasts, then a alone.
    cache_decode = nan_cache(num_blocks, TINY, dtype)
    rows_a, rows_b = [], []
    for t in range(45):
        pieces = [(a, t, t + 1)] + ([(b, t, t + 1)] if t < 30 else [])
        out = run_step(DECODE, weights, cache_decode, pieces)
        rows_a.append(out[:1])
        rows_b.extend([out[1:]] if t < 30 else [])
    torch.testing.assert_close(torch.cat(rows_a), full_a, **TOL[dtype])
    torch.testing.assert_close(torch.cat(rows_b), full_b, **TOL[dtype])
    torch.testing.assert_close(cache_decode, cache_full, rtol=0, atol=0, equal_nan=True)


@pytest.mark.parametrize("op", [PREFILL, DECODE], ids=["prefill", "decode"])
def test_block_layout_does_not_change_the_result(op):
    """Contiguous vs shuffled tables with more spare blocks hold the same rows, so the
    outputs are bit-identical; every slot outside the step's sequences is NaN (including
    block 0, where build_step's padding entries point), so outputs must be finite."""
    dtype = torch.float32
    lengths = [20, 38, 18, 32]
    outs = []
    for tables, num_blocks in [(contiguous_tables(lengths), 10), (shuffled_tables(lengths, 17, seed=5), 17)]:
        gen = torch.Generator().manual_seed(5)
        seqs = make_sequences(TINY, lengths, dtype, gen, tables)
        weights = make_weights(TINY, dtype, gen)
        cache = nan_cache(num_blocks, TINY, dtype)
        for seq, (context_len, _) in zip(seqs, SPANS):
            preload(cache, seq, context_len)
        # seqs[2] is absent from this step; its blocks (mid-table) stay poisoned.
        pieces = [(seq, s, e) for i, (seq, (s, e)) in enumerate(zip(seqs, SPANS)) if i != 2]
        out = run_step(op, weights, cache, pieces)
        assert torch.isfinite(out).all()
        outs.append(out)
    torch.testing.assert_close(outs[1], outs[0], rtol=0, atol=0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cache_holds_inserted_rows(dtype):
    weights, cache, pieces = mixed_batch(TINY, dtype, seed=6, spans=SPANS)
    before = cache.clone()
    step = build_step([([0] * (e - s), s, 0, seq.table) for seq, s, e in pieces], BLOCK_SIZE)
    run_step(PREFILL, weights, cache, pieces)

    flat, flat_before = cache.view(-1, TINY.width), before.view(-1, TINY.width)
    slots = step.slot_mapping.long()
    inserted = torch.cat([seq.latents[s:e] for seq, s, e in pieces])
    torch.testing.assert_close(flat[slots], inserted, rtol=0, atol=0)
    untouched = torch.ones(flat.shape[0], dtype=torch.bool)
    untouched[slots] = False
    torch.testing.assert_close(flat[untouched], flat_before[untouched], rtol=0, atol=0, equal_nan=True)
    # Read back through the block tables: the whole history of each sequence.
    for b, (seq, _, end) in enumerate(pieces):
        rows = mla.gather_latents(cache, step.block_tables[b], end)
        torch.testing.assert_close(rows, seq.latents[:end], rtol=0, atol=0)


def _bad_inputs():
    """(tensor name expected in the message, function that breaks the argument list)."""
    def at(name):
        return [t.name for t in MLA_PREFILL.inputs].index(name)

    def replace(name, make):
        def edit(args):
            args[at(name)] = make(args[at(name)])
        return edit

    return [
        ("q", replace("q", lambda t: t[:, :-1])),
        ("q", replace("q", lambda t: t[:, :, :-1])),
        ("latent", replace("latent", lambda t: t[:, :-1])),
        ("latent", replace("latent", lambda t: t[:-1])),
        ("w_uk", replace("w_uk", lambda t: t[:, :, :-1])),
        ("w_uv", replace("w_uv", lambda t: t[:, :-1])),
        ("cu_seqlens", replace("cu_seqlens", lambda t: t - t.new_tensor([0, 0, 0, 1]))),
        ("context_lens", replace("context_lens", lambda t: t[:-1])),
        ("context_lens", replace("context_lens", lambda t: t - 1)),
        ("block_tables", replace("block_tables", lambda t: t[:, :1])),
        ("block_tables", replace("block_tables", lambda t: t + 100)),
        ("slot_mapping", replace("slot_mapping", lambda t: t + 10_000)),
        ("slot_mapping", replace("slot_mapping", lambda t: torch.zeros_like(t))),
        ("slot_mapping", replace("slot_mapping", lambda t: t.long())),
        ("latent_cache", replace("latent_cache", lambda t: t[..., :-1])),
    ]


@pytest.mark.parametrize("op", [PREFILL, DECODE], ids=["prefill", "decode"])
@pytest.mark.parametrize("name,edit", _bad_inputs())
def test_bad_inputs_raise(op, name, edit):
    weights, cache, pieces = mixed_batch(TINY, torch.float32, seed=7, spans=[(0, 3), (20, 21), (2, 5)])
    step = build_step([([0] * (e - s), s, 0, seq.table) for seq, s, e in pieces], BLOCK_SIZE)
    args = [torch.cat([seq.q[s:e] for seq, s, e in pieces]),
            torch.cat([seq.latents[s:e] for seq, s, e in pieces]),
            weights.w_uk, weights.w_uv, step.cu_seqlens, step.context_lens, step.block_tables,
            step.slot_mapping, cache]
    op(*args, *TINY.attrs())  # the unedited arguments are accepted
    edit(args)
    with pytest.raises(ValueError, match=name):
        op(*args, *TINY.attrs())


def test_fake_and_functional_forms_agree_with_the_op():
    weights, cache, pieces = mixed_batch(TINY, torch.float32, seed=8, spans=SPANS)
    step = build_step([([0] * (e - s), s, 0, seq.table) for seq, s, e in pieces], BLOCK_SIZE)
    args = [torch.cat([seq.q[s:e] for seq, s, e in pieces]),
            torch.cat([seq.latents[s:e] for seq, s, e in pieces]),
            weights.w_uk, weights.w_uv, step.cu_seqlens, step.context_lens, step.block_tables,
            step.slot_mapping]
    cache_before = cache.clone()
    out, new_cache = torch.ops.k3.mla_decode_functional(*args, cache, *TINY.attrs())
    torch.testing.assert_close(cache, cache_before, rtol=0, atol=0, equal_nan=True)  # input untouched
    expected = DECODE(*args, cache, *TINY.attrs())
    torch.testing.assert_close(out, expected, rtol=0, atol=0)
    torch.testing.assert_close(new_cache, cache, rtol=0, atol=0, equal_nan=True)

    with FakeTensorMode() as mode:
        fake_args = [mode.from_tensor(t) for t in args + [cache]]
        fake_out = PREFILL(*fake_args, *TINY.attrs())
    assert fake_out.shape == expected.shape and fake_out.dtype == expected.dtype
