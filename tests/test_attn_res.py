"""AttnRes: the two-phase online-softmax form (block statistics once per block, partial sum
merged per sub-layer) reproduces the original per-sub-layer mixture (spec §4.7.2 vs §4.7.4)
over a whole synthetic residual stream, and the mixture matches a plain formula."""
from __future__ import annotations

import math

import torch

from k3_trtllm.ops import attn_res


def test_mix_matches_plain_formula():
    g = torch.Generator().manual_seed(0)
    T, d, eps = 5, 16, 1e-5
    sources = [torch.randn(T, d, generator=g, dtype=torch.float64) * (i + 1) for i in range(4)]
    w_norm, w_proj = torch.randn(d, generator=g, dtype=torch.float64), torch.randn(d, generator=g, dtype=torch.float64)
    out = attn_res.mix(sources, w_norm * w_proj, eps)
    for t in range(T):
        # w_proj · RMSNorm(v; w_norm), softmax over sources, weighted sum — token by token
        logits = [float(w_proj @ (v[t] / math.sqrt(float((v[t] ** 2).mean()) + eps) * w_norm)) for v in sources]
        p = torch.softmax(torch.tensor(logits, dtype=torch.float64), 0)
        expected = sum(p[i] * sources[i][t] for i in range(len(sources)))
        torch.testing.assert_close(out[t], expected, rtol=1e-12, atol=1e-12)


def _run_stream(num_layers, block, queries, deltas, embed, eps, two_phase):
    """Drive the residual stream of §3 with given sub-layer outputs; return every mixed input."""
    inputs, blocks, partial = [], [], embed
    stats = {}
    for layer in range(num_layers):
        write = layer % block == 0
        if two_phase:
            if write:
                blocks.append(partial)
                partial = None
                # Phase 1 once per block, for both queries of every layer in the block.
                stats = {l: [attn_res.phase1(blocks, q, eps) for q in queries[l]]
                         for l in range(layer, min(layer + block, num_layers))}
            h = attn_res.phase2(stats[layer][0], partial, queries[layer][0], eps)
        else:
            n_a = math.ceil(layer / block)
            h = attn_res.mix(blocks[:n_a] + [partial], queries[layer][0], eps) if n_a else partial
            if write:
                blocks.append(partial)
                partial = torch.zeros_like(partial)
        inputs.append(h)
        partial = deltas[layer][0] if partial is None else partial + deltas[layer][0]
        if two_phase:
            m = attn_res.phase2(stats[layer][1], partial, queries[layer][1], eps)
        else:
            m = attn_res.mix(blocks[: layer // block + 1] + [partial], queries[layer][1], eps)
        inputs.append(m)
        partial = partial + deltas[layer][1]
    return inputs


def test_two_phase_equals_original_over_a_stream():
    g = torch.Generator().manual_seed(1)
    T, d, L, S, eps = 3, 32, 10, 4, 1e-5
    f64 = dict(generator=g, dtype=torch.float64)
    queries = [[torch.randn(d, **f64) / math.sqrt(d) for _ in range(2)] for _ in range(L)]
    deltas = [[torch.randn(T, d, **f64) for _ in range(2)] for _ in range(L)]
    embed = torch.randn(T, d, **f64)
    original = _run_stream(L, S, queries, deltas, embed, eps, two_phase=False)
    two_phase = _run_stream(L, S, queries, deltas, embed, eps, two_phase=True)
    assert len(original) == 2 * L
    for a, b in zip(original, two_phase):
        torch.testing.assert_close(a.to(torch.float64), b, rtol=1e-12, atol=1e-12)
