"""CUDA MLA kernels (plugins/c_api/mla.cu) against the fp32 reference ops.

Skipped without CUDA. Needs the kernel library (build_scripts/build_kernels.sh or
K3_KERNELS_LIB). Tolerance: relative Frobenius error <= 1e-2 for both forms. Inputs and
output are bf16 and both sides accumulate in fp32. The absorbed kernels additionally round
the absorbed query q_nope·W_UK, the probabilities and the latent output a_lat to bf16; the
expanded prefill rounds the expanded K_nope = W_UK·ĉ_kv and V = W_UV·ĉ_kv (as a bf16 model
does) and the probabilities. Each is a relative error of at most 2^-9 per element, random
in sign, three of them in series: ~3e-3 to 5e-3 in practice (session-10 absorbed prefill
vs SDPA: 4.3e-3 to 4.7e-3). A wrong mask, a missing pass or split, a misplaced pass
boundary or a stale tile moves the error to O(1e-1) or more.
The latent cache must equal the reference's bit for bit (both copy the same bf16 rows).
"""
from __future__ import annotations

import functools

import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")

K3 = dict(nope=128, rope=64, rank=512, v=128)
TINY = dict(nope=32, rope=16, rank=64, v=32)  # spec §8 tiny configuration
TOL = 1e-2


@pytest.fixture(scope="module")
def ops():
    from k3_trtllm.ops.mla import cuda as cuda_mla  # registers the CUDA kernels
    from k3_trtllm.ops.mla import reference as reference
    return cuda_mla, reference


def make_step(heads, dims, contexts, new_tokens, block_size, seed):
    """A paged batch: random bf16 data, blocks scattered over a larger pool."""
    gen = torch.Generator(device="cuda").manual_seed(seed)
    dev = "cuda"
    width = dims["rank"] + dims["rope"]
    totals = [c + n for c, n in zip(contexts, new_tokens)]
    blocks_per_seq = [max(1, -(-t // block_size)) for t in totals]
    max_blocks = max(blocks_per_seq)
    pool = sum(blocks_per_seq) + 7
    perm = torch.randperm(pool, generator=gen, device=dev).to(torch.int32)
    block_tables = torch.zeros(len(contexts), max_blocks, dtype=torch.int32, device=dev)
    used = 0
    for b, nb in enumerate(blocks_per_seq):
        block_tables[b, :nb] = perm[used:used + nb]
        used += nb
    cache = torch.randn(pool, block_size, width, generator=gen, device=dev).to(torch.bfloat16)
    slots = []
    for b, (c, n) in enumerate(zip(contexts, new_tokens)):
        pos = torch.arange(c, c + n, device=dev)
        slots.append(block_tables[b, pos // block_size].long() * block_size + pos % block_size)
    num_tokens = sum(new_tokens)
    cu = torch.tensor([0] + list(torch.tensor(new_tokens).cumsum(0)), dtype=torch.int32, device=dev)
    q = torch.randn(num_tokens, heads, dims["nope"] + dims["rope"], generator=gen, device=dev)
    latent = torch.randn(num_tokens, width, generator=gen, device=dev)
    w_uk = torch.randn(heads, dims["nope"], dims["rank"], generator=gen, device=dev) / dims["nope"] ** 0.5
    w_uv = torch.randn(heads, dims["v"], dims["rank"], generator=gen, device=dev) / dims["rank"] ** 0.5
    bf = torch.bfloat16
    return dict(
        q=q.to(bf), latent=latent.to(bf), w_uk=w_uk.to(bf), w_uv=w_uv.to(bf), cu_seqlens=cu,
        context_lens=torch.tensor(contexts, dtype=torch.int32, device=dev), block_tables=block_tables,
        slot_mapping=torch.cat(slots).to(torch.int32) if slots else torch.zeros(0, dtype=torch.int32, device=dev),
        latent_cache=cache,
    )


def run_both(kernel, reference, step, heads, dims):
    scale = (dims["nope"] + dims["rope"]) ** -0.5
    attrs = (heads, dims["nope"], dims["rope"], dims["rank"], dims["v"], scale)
    names = ("q", "latent", "w_uk", "w_uv", "cu_seqlens", "context_lens", "block_tables", "slot_mapping")
    cache_k, cache_r = step["latent_cache"].clone(), step["latent_cache"].clone()
    out_k = kernel(*(step[n] for n in names), cache_k, *attrs)
    out_r = reference(*(step[n] for n in names), cache_r, *attrs)
    torch.cuda.synchronize()
    return out_k, out_r, cache_k, cache_r


def assert_close(out_k, out_r, cache_k, cache_r, original_cache):
    assert out_k.shape == out_r.shape and out_k.dtype == torch.bfloat16
    assert torch.isfinite(out_k).all()
    err = ((out_k.float() - out_r.float()).norm() / out_r.float().norm()).item()
    assert err <= TOL, f"relative error {err:.3e}"
    assert torch.equal(cache_k, cache_r)
    assert not torch.equal(cache_k, original_cache) or cache_k.numel() == 0


@pytest.mark.parametrize("heads,dims", [(96, K3), (12, K3), (4, TINY)])
@pytest.mark.parametrize("block_size", [64, 80])
def test_decode_mixed_lengths(ops, heads, dims, block_size):
    cuda_mla, reference = ops
    contexts = [0, 1, 63, 64, 1000, 3000]
    step = make_step(heads, dims, contexts, [1] * len(contexts), block_size, seed=heads + block_size)
    res = run_both(cuda_mla.mla_decode_cuda, reference.mla_decode, step, heads, dims)
    assert_close(*res, step["latent_cache"])


@pytest.mark.parametrize("heads,dims", [(96, K3), (12, K3), (4, TINY)])
def test_chunked_prefill_matches_expanded_reference(ops, heads, dims):
    """New tokens after cached context, an empty sequence, one-token and long chunks;
    the reference is the expanded (non-absorbed) form, the kernel the absorbed one."""
    cuda_mla, reference = ops
    contexts, new = [0, 500, 129, 7, 64], [300, 77, 1, 0, 64]
    step = make_step(heads, dims, contexts, new, 64, seed=3 * heads)
    res = run_both(cuda_mla.mla_prefill_cuda, reference.mla_prefill, step, heads, dims)
    assert_close(*res, step["latent_cache"])


def test_multi_token_decode(ops):
    """Several new tokens per sequence (speculative decode): each sees its own prefix."""
    cuda_mla, reference = ops
    step = make_step(16, K3, [40, 2000, 0], [3, 4, 2], 64, seed=11)
    res = run_both(cuda_mla.mla_decode_cuda, reference.mla_decode, step, 16, K3)
    assert_close(*res, step["latent_cache"])


@pytest.mark.parametrize("heads", [128, 16])
def test_long_context_many_splits(ops, heads):
    """One long and one short sequence: the long one is split across many CTAs, most
    splits of the short one are empty and must not contribute."""
    cuda_mla, reference = ops
    step = make_step(heads, K3, [20000, 5], [1, 1], 64, seed=heads)
    res = run_both(cuda_mla.mla_decode_cuda, reference.mla_decode, step, heads, K3)
    assert_close(*res, step["latent_cache"])


def test_latent_attention_matches_absorbed_formula(ops):
    """The attention-only entry against a plain softmax over the gathered latents."""
    cuda_mla, _ = ops
    heads, nope, rank = 24, 128, 512
    step = make_step(heads, K3, [700], [1], 64, seed=5)
    gen = torch.Generator(device="cuda").manual_seed(6)
    q_lat = torch.randn(1, heads, rank, generator=gen, device="cuda").to(torch.bfloat16)
    scale = 0.07
    a_lat = cuda_mla.latent_attention(q_lat, step["q"], step["cu_seqlens"], step["context_lens"],
                                      step["block_tables"], step["latent_cache"], nope, scale)
    pos = torch.arange(700 + 1, device="cuda")  # the new token itself was not inserted
    rows = step["latent_cache"][step["block_tables"][0, pos // 64].long(), pos % 64].float()
    query = torch.cat([q_lat[0].float(), step["q"][0, :, nope:].float()], dim=-1)
    probs = torch.softmax(query @ rows.T * scale, dim=-1)
    want = probs @ rows[:, :rank]
    err = ((a_lat[0].float() - want).norm() / want.norm()).item()
    assert err <= TOL, f"relative error {err:.3e}"


@pytest.mark.parametrize("heads,dims", [(96, K3), (12, K3), (3, TINY)])
@pytest.mark.parametrize("key_chunk", [0, 384])
def test_expanded_prefill_mixed_contexts(ops, heads, dims, key_chunk):
    """The expanded form forced: contexts 0, 1, 63, 64 and > 1000 already cached, new-token
    counts crossing the 128-row query tile, an empty sequence. key_chunk 384 splits the
    ~3000 keys into passes whose boundaries fall inside sequences and key tiles, merged
    through the fp32 log-sum-exp accumulator; 0 is one pass. 3 tiny heads give a partial
    column tile in the expansion GEMM."""
    cuda_mla, reference = ops
    contexts, new = [0, 1, 63, 64, 1000, 1300, 40], [200, 130, 1, 64, 257, 0, 129]
    step = make_step(heads, dims, contexts, new, 64, seed=7 * heads + key_chunk)
    kernel = functools.partial(cuda_mla.prefill_expanded, key_chunk=key_chunk)
    res = run_both(kernel, reference.mla_prefill, step, heads, dims)
    assert_close(*res, step["latent_cache"])


@pytest.mark.parametrize("heads", [96, 97])
@pytest.mark.parametrize("key_chunk", [0, 1024])
def test_expanded_prefill_head_groups(ops, heads, key_chunk):
    """Enough query tiles x heads (30 tiles x 96 heads on 132 SMs) that the wgmma kernel
    numbers its items by groups of heads (2 groups here; 97 heads: the last one smaller):
    every item is still computed once. A 2900-token sequence, a 300-token chunk after a
    2000-token context, a short one; 1024-key passes and one pass."""
    cuda_mla, reference = ops
    contexts, new = [0, 2000, 5], [2900, 300, 200]
    step = make_step(heads, K3, contexts, new, 64, seed=41 + heads + key_chunk)
    kernel = functools.partial(cuda_mla.prefill_expanded, key_chunk=key_chunk)
    res = run_both(kernel, reference.mla_prefill, step, heads, K3)
    assert_close(*res, step["latent_cache"])


def test_prefill_workspace_one_pass_past_cap(ops):
    """Past the 512 MB pass cap the expanded form still takes one key pass where its K/V need
    no more bytes than capped passes with their fp32 accumulators (a fresh 16384-token prefill
    at 96 heads: 16384 keys in one pass, less workspace than 10880-key passes); a chunk after
    a 100k-token context keeps capped passes (bounded workspace). The op's workspace query and
    the expanded entry's agree."""
    cuda_mla, _ = ops
    lib = cuda_mla._lib()
    dims = (K3["nope"], K3["rope"], K3["rank"], K3["v"])
    per_key = 96 * (K3["nope"] + K3["v"]) * 2 + K3["rope"] * 2

    def sizes(tokens, keys):
        return (tokens, 1, 96, *dims, -(-keys // 64), 64)

    fresh = sizes(16384, 16384)
    one = lib.k3_mla_prefill_expanded_workspace_size(*fresh, 0)
    assert lib.k3_mla_prefill_workspace_size(*fresh) == one
    assert 16384 * per_key <= one < lib.k3_mla_prefill_expanded_workspace_size(*fresh, 10880)
    chunk = sizes(512, 100_000 + 512)
    capped = lib.k3_mla_prefill_workspace_size(*chunk)
    assert capped == lib.k3_mla_prefill_expanded_workspace_size(*chunk, 0)
    assert capped < (512 << 20) + 512 * 96 * (K3["v"] + 1) * 4 + (1 << 20) < (100_000 + 512) * per_key


@pytest.mark.parametrize("heads", [96, 12])
def test_prefill_dispatch(ops, heads):
    """The op picks the expanded form for >= 384 new tokens per sequence on average (here a
    600-token chunk after a 2500-token context, block size 80) and the absorbed one below
    (80 per sequence); both match the reference."""
    cuda_mla, reference = ops
    for contexts, new, expanded in (([2500], [600], True), ([2500, 3], [100, 60], False)):
        step = make_step(heads, K3, contexts, new, 80, seed=heads + len(new))
        sizes = (sum(new), len(new), heads, K3["nope"], K3["rope"], K3["rank"], K3["v"],
                 step["block_tables"].shape[1], 80)
        assert cuda_mla.prefill_uses_expanded(*sizes) == expanded
        res = run_both(cuda_mla.mla_prefill_cuda, reference.mla_prefill, step, heads, K3)
        assert_close(*res, step["latent_cache"])


@pytest.mark.parametrize("heads,context", [(96, 1000), (128, 5000), (64, 130)])
def test_latent_attention_rising_maxima(ops, heads, context):
    """Scores whose running maximum jumps by far more than the wgmma kernel's lazy-rescale
    slack (2^8) part-way through a KV split, in the first and in the second half of 64-token
    tiles (the halves belong to different warpgroups), over one split (130 tokens), a padded
    head group (96) and many splits merged by the combine kernel (5000 tokens at 128 heads).
    A row rescaled too late or by one warpgroup only is off by O(1)."""
    cuda_mla, _ = ops
    nope, rank = 128, 512
    step = make_step(heads, K3, [context], [1], 64, seed=heads + context)
    cache = step["latent_cache"]
    gen = torch.Generator(device="cuda").manual_seed(heads)
    q_lat = torch.randn(1, heads, rank, generator=gen, device="cuda").to(torch.bfloat16)
    pos = torch.arange(context + 1, device="cuda")
    slots = (step["block_tables"][0, pos // 64].long(), pos % 64)
    # Growing spikes: rows 8-24x larger at positions in both tile halves and late in the range.
    for k, p in enumerate([p for p in (5, 40, 97, 300, 611, 900, 2100, 4444) if p <= context]):
        cache[slots[0][p], slots[1][p]] *= 8 + 2 * k
    scale = 0.07
    a_lat = cuda_mla.latent_attention(q_lat, step["q"], step["cu_seqlens"], step["context_lens"],
                                      step["block_tables"], cache, nope, scale)
    rows = cache[slots].float()
    query = torch.cat([q_lat[0].float(), step["q"][0, :, nope:].float()], dim=-1)
    probs = torch.softmax(query @ rows.T * scale, dim=-1)
    want = probs @ rows[:, :rank]
    assert torch.isfinite(a_lat).all()
    err = ((a_lat[0].float() - want).norm() / want.norm()).item()
    assert err <= TOL, f"relative error {err:.3e}"


# ---- The fp8 latent cache (contracts mla_*_fp8, k3_trtllm/ops/mla/fp8_cache.py) ----------
# The kernels and the reference read the SAME fp8 cache, whose dequantised values code * scale
# are exact in fp32; the dequantising kernels round them to bf16 operands (one more 2^-9
# relative rounding than the bf16 path's inputs carry), the direct one (K3 latent, <= 16
# heads, Q 128) multiplies exact f16 codes and applies the scales in fp32 (its probabilities
# are f16: 2^-11), so the bf16 path's tolerance TOL holds. The cache after the insert must
# equal the reference quantiser's bytes exactly.


def fp8_step(heads, dims, contexts, new_tokens, block_size, seed, edge_cases=False):
    """make_step with the pool quantised into fp8 rows; with ``edge_cases``, new latents that
    exercise the quantiser: an all-zero row (every scale 1.0), a row with one zero group, a
    tiny and a huge row (scales far from 1), exact ties of e4m3 rounding (normal and
    subnormal). Those rows' outputs would dominate an error norm: bytes-only tests use them."""
    from k3_trtllm.ops.mla import fp8_cache
    step = make_step(heads, dims, contexts, new_tokens, block_size, seed)
    q_group = fp8_cache.scale_group_for(dims["rank"])
    step["latent_cache"] = fp8_cache.quantize(step["latent_cache"], dims["rank"], q_group)
    latent = step["latent"]
    n = latent.shape[0] if edge_cases else 0
    if n >= 4:
        latent[0] = 0
        latent[1, :q_group] = 0
        latent[2] *= 1e-30
        latent[3] *= 1e30
    if n >= 5:  # amax 448 (scale exactly 1) and values halfway between e4m3 neighbours: ties to even
        mids = torch.tensor([(1 + (2 * k + 1) / 16) * 2.0 ** j for j in range(-6, 8) for k in range(8)]
                            + [(2 * k + 1) * 2.0 ** -10 for k in range(8)], device="cuda")
        groups = latent[4, : dims["rank"]].view(-1, q_group)
        groups[:] = mids[torch.arange(q_group, device="cuda") % mids.numel()].to(latent.dtype)
        groups[:, 0] = 448
    return step, q_group


def run_both_fp8(kernel, reference, step, heads, dims, q_group):
    scale = (dims["nope"] + dims["rope"]) ** -0.5
    attrs = (heads, dims["nope"], dims["rope"], dims["rank"], dims["v"], scale, q_group)
    names = ("q", "latent", "w_uk", "w_uv", "cu_seqlens", "context_lens", "block_tables", "slot_mapping")
    cache_k, cache_r = step["latent_cache"].clone(), step["latent_cache"].clone()
    out_k = kernel(*(step[n] for n in names), cache_k, *attrs)
    out_r = reference(*(step[n] for n in names), cache_r, *attrs)
    torch.cuda.synchronize()
    return out_k, out_r, cache_k, cache_r


def test_fp8_insert_writes_the_quantisers_bytes(ops):
    """Every new row's bytes (codes, scales, rope) equal fp8_cache.quantize's, edge cases included."""
    cuda_mla, _ = ops
    from k3_trtllm.ops.mla import fp8_cache
    step, q_group = fp8_step(12, K3, [3, 70, 0], [5, 1, 3], 64, seed=41, edge_cases=True)
    before = step["latent_cache"].clone()
    res = run_both_fp8(cuda_mla.mla_decode_fp8_cuda, reference_fp8("decode"), step, 12, K3, q_group)
    cache_k = res[2]
    slots = step["slot_mapping"].long()
    flat = cache_k.view(-1, cache_k.shape[-1])
    want = fp8_cache.quantize(step["latent"], K3["rank"], q_group)
    assert flat.shape[-1] == 656
    got = flat[slots]
    for part, cols in (("codes", slice(0, 512)), ("scales", slice(512, 528)), ("rope", slice(528, 656))):
        wrong = (got[:, cols] != want[:, cols]).sum().item()
        assert wrong == 0, f"{wrong} {part} bytes differ"
    mask = torch.ones(flat.shape[0], dtype=torch.bool, device="cuda")
    mask[slots] = False
    assert torch.equal(flat[mask], before.view(-1, 656)[mask])  # nothing else written


def reference_fp8(kind):
    from k3_trtllm.ops.mla import reference
    return reference.mla_decode_fp8 if kind == "decode" else reference.mla_prefill_fp8


@pytest.mark.parametrize("heads", [128, 96, 12])
@pytest.mark.parametrize("block_size", [64, 80])
def test_fp8_decode_mixed_lengths(ops, heads, block_size):
    cuda_mla, _ = ops
    contexts = [0, 1, 63, 64, 1000, 3000]
    step, q_group = fp8_step(heads, K3, contexts, [1] * len(contexts), block_size, seed=heads + block_size)
    res = run_both_fp8(cuda_mla.mla_decode_fp8_cuda, reference_fp8("decode"), step, heads, K3, q_group)
    assert_close(*res, step["latent_cache"])


@pytest.mark.parametrize("heads", [128, 12])
def test_fp8_decode_32k_context(ops, heads):
    """A 32k-token sequence (many splits) beside a short one, at both attention kernels."""
    cuda_mla, _ = ops
    step, q_group = fp8_step(heads, K3, [32767, 9], [1, 1], 64, seed=5 * heads)
    res = run_both_fp8(cuda_mla.mla_decode_fp8_cuda, reference_fp8("decode"), step, heads, K3, q_group)
    assert_close(*res, step["latent_cache"])


@pytest.mark.parametrize("heads", [96, 12])
def test_fp8_chunked_prefill_absorbed(ops, heads):
    cuda_mla, _ = ops
    contexts, new = [0, 500, 129, 7, 64], [300, 77, 1, 0, 64]
    step, q_group = fp8_step(heads, K3, contexts, new, 64, seed=3 * heads + 1)
    assert not cuda_mla.prefill_uses_expanded(sum(new), len(new), heads, K3["nope"], K3["rope"], K3["rank"], K3["v"],
                                              step["block_tables"].shape[1], 64, fp8=True)
    res = run_both_fp8(cuda_mla.mla_prefill_fp8_cuda, reference_fp8("prefill"), step, heads, K3, q_group)
    assert_close(*res, step["latent_cache"])


@pytest.mark.parametrize("heads", [96, 12])
@pytest.mark.parametrize("key_chunk", [0, 384])
def test_fp8_expanded_prefill(ops, heads, key_chunk):
    """The expanded form over the fp8 cache: each pass's keys dequantised, then expanded;
    passes of 384 keys put boundaries inside sequences."""
    cuda_mla, _ = ops
    contexts, new = [0, 1, 63, 1000, 1300, 40], [200, 130, 1, 257, 0, 129]
    step, q_group = fp8_step(heads, K3, contexts, new, 64, seed=7 * heads + key_chunk + 1)
    kernel = functools.partial(cuda_mla.prefill_expanded, key_chunk=key_chunk)
    res = run_both_fp8(kernel, reference_fp8("prefill"), step, heads, K3, q_group)
    assert_close(*res, step["latent_cache"])


def test_fp8_prefill_dispatch_takes_the_expanded_form(ops):
    cuda_mla, _ = ops
    step, q_group = fp8_step(12, K3, [2500], [600], 80, seed=17)
    assert cuda_mla.prefill_uses_expanded(600, 1, 12, K3["nope"], K3["rope"], K3["rank"], K3["v"],
                                          step["block_tables"].shape[1], 80, fp8=True)
    res = run_both_fp8(cuda_mla.mla_prefill_fp8_cuda, reference_fp8("prefill"), step, 12, K3, q_group)
    assert_close(*res, step["latent_cache"])


def test_fp8_latent_attention_matches_the_formula_over_dequantised_rows(ops):
    cuda_mla, _ = ops
    from k3_trtllm.ops.mla import fp8_cache
    heads, nope, rank = 64, 128, 512
    step, q_group = fp8_step(heads, K3, [5000], [1], 64, seed=8)
    gen = torch.Generator(device="cuda").manual_seed(9)
    q_lat = torch.randn(1, heads, rank, generator=gen, device="cuda").to(torch.bfloat16)
    a_lat = cuda_mla.latent_attention(q_lat, step["q"], step["cu_seqlens"], step["context_lens"],
                                      step["block_tables"], step["latent_cache"], nope, 0.07, scale_group=q_group)
    pos = torch.arange(5000 + 1, device="cuda")
    raw = step["latent_cache"][step["block_tables"][0, pos // 64].long(), pos % 64]
    rows = fp8_cache.dequantize(raw, rank, K3["rope"], q_group)
    query = torch.cat([q_lat[0].float(), step["q"][0, :, nope:].float()], dim=-1)
    want = torch.softmax(query @ rows.T * 0.07, dim=-1) @ rows[:, :rank]
    err = ((a_lat[0].float() - want).norm() / want.norm()).item()
    assert err <= TOL, f"relative error {err:.3e}"


@pytest.mark.parametrize("heads", [12, 16])
@pytest.mark.parametrize("q_group", [128, 64])
def test_fp8_latent_attention_wide_scales(ops, heads, q_group):
    """<= 16 heads over rows whose group scales span 2^-10..2^2 token by token (so the
    tiles' largest and smallest scales differ by ~2^12) and query rows of magnitudes
    2^-8..2^3 per head: Q 128 runs the direct kernel (f16 operands, scales in the fp32
    math, per-tile exponents), Q 64 the dequantising one; both against the formula over the
    dequantised rows."""
    cuda_mla, _ = ops
    from k3_trtllm.ops.mla import fp8_cache
    nope, rank, rope, context = 128, 512, 64, 3000
    step = make_step(heads, K3, [context], [1], 64, seed=60 + heads + q_group)
    gen = torch.Generator(device="cuda").manual_seed(61 + heads)
    pool = step["latent_cache"].float()
    mags = 2.0 ** (torch.rand(*pool.shape[:2], rank // q_group, generator=gen, device="cuda") * 12 - 10)
    pool[..., :rank] *= mags.repeat_interleave(q_group, -1)
    cache = fp8_cache.quantize(pool, rank, q_group)
    q_lat = torch.randn(1, heads, rank, generator=gen, device="cuda")
    q_lat *= 2.0 ** (torch.rand(1, heads, 1, generator=gen, device="cuda") * 11 - 8)
    q_lat = q_lat.to(torch.bfloat16)
    a_lat = cuda_mla.latent_attention(q_lat, step["q"], step["cu_seqlens"], step["context_lens"],
                                      step["block_tables"], cache, nope, 0.07, scale_group=q_group)
    pos = torch.arange(context + 1, device="cuda")
    rows = fp8_cache.dequantize(cache[step["block_tables"][0, pos // 64].long(), pos % 64], rank, rope, q_group)
    query = torch.cat([q_lat[0].float(), step["q"][0, :, nope:].float()], dim=-1)
    want = torch.softmax(query @ rows.T * 0.07, dim=-1) @ rows[:, :rank]
    err = ((a_lat[0].float() - want).norm(dim=-1) / want.norm(dim=-1)).max().item()  # every head
    assert err <= TOL, f"largest per-head relative error {err:.3e}"


@pytest.mark.parametrize("heads,context", [(12, 130), (16, 5000)])
def test_fp8_latent_attention_rising_maxima(ops, heads, context):
    """The fp8 cache at <= 16 heads (the direct kernel, Q 128) with scores whose running
    maximum jumps part-way through a split (rows 8-22x larger at growing positions, so their
    group scales, and the tiles' scale exponents, jump too): the output accumulator's
    rescale by alpha and by the exponent change must meet in every later tile; a row
    rescaled late, twice or not at all is off by O(1). One split (130 tokens) and many (5000)."""
    cuda_mla, _ = ops
    from k3_trtllm.ops.mla import fp8_cache
    nope, rank, rope, q_group = 128, 512, 64, 128
    step = make_step(heads, K3, [context], [1], 64, seed=70 + heads + context)
    pool = step["latent_cache"].float()
    pos = torch.arange(context + 1, device="cuda")
    slots = (step["block_tables"][0, pos // 64].long(), pos % 64)
    for k, p in enumerate([p for p in (5, 40, 97, 300, 611, 900, 2100, 4444) if p <= context]):
        pool[slots[0][p], slots[1][p]] *= 8 + 2 * k
    cache = fp8_cache.quantize(pool, rank, q_group)
    gen = torch.Generator(device="cuda").manual_seed(heads)
    q_lat = torch.randn(1, heads, rank, generator=gen, device="cuda").to(torch.bfloat16)
    a_lat = cuda_mla.latent_attention(q_lat, step["q"], step["cu_seqlens"], step["context_lens"],
                                      step["block_tables"], cache, nope, 0.07, scale_group=q_group)
    rows = fp8_cache.dequantize(cache[slots], rank, rope, q_group)
    query = torch.cat([q_lat[0].float(), step["q"][0, :, nope:].float()], dim=-1)
    want = torch.softmax(query @ rows.T * 0.07, dim=-1) @ rows[:, :rank]
    assert torch.isfinite(a_lat).all()
    err = ((a_lat[0].float() - want).norm(dim=-1) / want.norm(dim=-1)).max().item()  # every head
    assert err <= TOL, f"largest per-head relative error {err:.3e}"


def test_fp8_tiny_dims_fall_back_to_the_reference(ops):
    """The tiny model's 100-byte rows (R 64, Q 64, Dr 16) are not 16-byte multiples: the op
    warns once and runs the reference, whose result and cache it returns."""
    cuda_mla, _ = ops
    from k3_trtllm.ops.cuda_library import KernelFallbackWarning
    step, q_group = fp8_step(4, TINY, [0, 63, 300], [1, 1, 1], 64, seed=4)
    assert step["latent_cache"].shape[-1] == 100
    with pytest.warns(KernelFallbackWarning, match="fp8 latent rows of 100 bytes"):
        res = run_both_fp8(cuda_mla.mla_decode_fp8_cuda, reference_fp8("decode"), step, 4, TINY, q_group)
    assert torch.equal(res[0], res[1]) and torch.equal(res[2], res[3])
