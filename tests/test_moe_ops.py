"""k3::situ_moe / k3::situ_moe_mxfp4 reference ops (spec §4.3, §4.6, §7.1, §7.12-14)."""
from __future__ import annotations

import inspect
import math
from dataclasses import dataclass

import pytest
import torch

from k3_trtllm.ops.contract import SITU_MOE, SITU_MOE_MXFP4
from k3_trtllm.ops.moe import dequantize_mxfp4, quantize_mxfp4, reference, route

T, D, L, I = 20, 64, 64, 64


@dataclass(frozen=True)
class Routing:
    num_experts: int
    top_k: int
    num_expert_group: int = 1
    topk_group: int = 1


FLAT = Routing(8, 3)
GROUPED = Routing(16, 4, num_expert_group=4, topk_group=2)


def attrs(routing: Routing, expert_offset=0, scoring=0, renormalize=1, routed_scaling_factor=2.5,
          activation=1, situ_beta=4.0, situ_linear_beta=25.0) -> tuple:
    """The op's attributes in contract order, from keyword values."""
    values = dict(num_experts=routing.num_experts, top_k=routing.top_k,
                  num_expert_group=routing.num_expert_group, topk_group=routing.topk_group,
                  expert_offset=expert_offset, scoring=scoring, renormalize=renormalize,
                  routed_scaling_factor=routed_scaling_factor, activation=activation,
                  situ_beta=situ_beta, situ_linear_beta=situ_linear_beta)
    return tuple(values[a.name] for a in SITU_MOE.attrs)


def make_inputs(num_experts: int, dtype: torch.dtype, seed: int = 0, bias_std: float = 0.1):
    """x, z, router_weight, correction_bias, w13, w2 with O(1) logits and activations."""
    gen = torch.Generator().manual_seed(seed)
    router_dtype = torch.float64 if dtype == torch.float64 else torch.float32
    x = torch.randn(T, D, generator=gen, dtype=torch.float64).to(dtype)
    z = torch.randn(T, L, generator=gen, dtype=torch.float64).to(dtype)
    router_weight = (torch.randn(num_experts, D, generator=gen, dtype=torch.float64) / D ** 0.5).to(router_dtype)
    bias = (bias_std * torch.randn(num_experts, generator=gen, dtype=torch.float64)).to(router_dtype)
    w13 = (torch.randn(num_experts, 2 * I, L, generator=gen, dtype=torch.float64) * 2 / L ** 0.5).to(dtype)
    w2 = (torch.randn(num_experts, L, I, generator=gen, dtype=torch.float64) / I ** 0.5).to(dtype)
    return x, z, router_weight, bias, w13, w2


# ---------------------------------------------------------------------------
# 1. Router vs a per-token brute force.
# ---------------------------------------------------------------------------
def brute_force_route(x, router_weight, bias, top_k, num_expert_group, topk_group, scoring, renormalize,
                      scaling):
    """Per token: Python-float scores, sort experts by biased score (within the best
    groups when E splits into num_expert_group groups of >= 2), weight by unbiased score."""
    xs, ws, bs = x.double().tolist(), router_weight.double().tolist(), bias.double().tolist()
    num_experts = len(ws)
    all_ids, all_weights = [], []
    for row in xs:
        logits = [math.fsum(a * b for a, b in zip(row, w)) for w in ws]
        if scoring == 0:
            scores = [1 / (1 + math.exp(-v)) for v in logits]
        else:
            exps = [math.exp(v - max(logits)) for v in logits]
            scores = [v / sum(exps) for v in exps]
        biased = [s + b for s, b in zip(scores, bs)]
        candidates = list(range(num_experts))
        if num_expert_group > 1 and num_experts > num_expert_group and num_experts % num_expert_group == 0:
            size = num_experts // num_expert_group
            groups = [list(range(g * size, (g + 1) * size)) for g in range(num_expert_group)]
            group_score = [sum(sorted((biased[e] for e in grp), reverse=True)[:2]) for grp in groups]
            kept = sorted(range(num_expert_group), key=lambda g: group_score[g], reverse=True)[:topk_group]
            candidates = [e for g in kept for e in groups[g]]
        chosen = sorted(candidates, key=lambda e: biased[e], reverse=True)[:top_k]
        weights = [scores[e] for e in chosen]
        if renormalize:
            weights = [w / sum(weights) for w in weights]
        all_ids.append(chosen)
        all_weights.append([w * scaling for w in weights])
    return torch.tensor(all_ids), torch.tensor(all_weights, dtype=torch.float64)


ROUTINGS = [FLAT, GROUPED,
            Routing(16, 4, num_expert_group=3, topk_group=2),  # 16 % 3 != 0: plain top-k
            Routing(4, 2, num_expert_group=4, topk_group=2)]  # E <= G: plain top-k


@pytest.mark.parametrize("routing", ROUTINGS)
@pytest.mark.parametrize("scoring", [0, 1])
@pytest.mark.parametrize("renormalize", [0, 1])
def test_route_matches_brute_force(routing, scoring, renormalize):
    # fp64 so that both sides agree on every ordering (no near-ties at 1e-15 with these
    # random scores); weights to 1e-12 relative (different summation orders only).
    bias_std = 0.1 if scoring == 0 else 0.5 / routing.num_experts  # comparable to the score spread
    x, _, router_weight, bias, *_ = make_inputs(routing.num_experts, torch.float64, seed=11, bias_std=bias_std)
    args = (routing.top_k, routing.num_expert_group, routing.topk_group, scoring, bool(renormalize), 2.5)
    ids, weights = route(x, router_weight, bias, *args)
    ref_ids, ref_weights = brute_force_route(x, router_weight, bias, *args)
    assert ids.dtype == torch.int64 and torch.equal(ids, ref_ids)
    torch.testing.assert_close(weights, ref_weights, rtol=1e-12, atol=0)
    # The case is only meaningful if the bias (and the grouping) changes some selections.
    unbiased_ids, _ = brute_force_route(x, router_weight, torch.zeros_like(bias), *args)
    assert not torch.equal(ids.sort(-1).values, unbiased_ids.sort(-1).values)
    if routing is GROUPED:
        flat_ids, _ = brute_force_route(x, router_weight, bias, routing.top_k, 1, 1, *args[3:])
        assert not torch.equal(ids.sort(-1).values, flat_ids.sort(-1).values)


@pytest.mark.parametrize("renormalize", [False, True])
def test_bias_selects_but_unbiased_score_weights(renormalize):
    logits = [3.0, 2.0, 1.0, 0.0, -1.0, -2.0, -3.0, -4.0]
    x = torch.tensor([[1.0, 0.0]])
    router_weight = torch.tensor([[v, 5.0] for v in logits])
    bias = torch.tensor([0.0] * 7 + [5.0])  # pushes the worst expert to the top
    ids, weights = route(x, router_weight, bias, 2, 1, 1, 0, renormalize, 1.0)
    assert ids.tolist() == [[7, 0]]
    expected = [1 / (1 + math.exp(4.0)), 1 / (1 + math.exp(-3.0))]  # sigmoid(-4), sigmoid(3)
    if renormalize:
        expected = [v / sum(expected) for v in expected]
    torch.testing.assert_close(weights, torch.tensor([expected]), rtol=1e-6, atol=0)  # fp32 sigmoid


def test_router_logits_are_fp32_for_bf16_activations():
    # Same selection as routing the bf16 values in fp64: a bf16 router would reorder experts.
    x, _, router_weight, bias, *_ = make_inputs(16, torch.bfloat16, seed=5)
    ids, weights = route(x, router_weight, bias, 4, 4, 2, 0, True, 1.0)
    ids64, weights64 = route(x.double(), router_weight.double(), bias.double(), 4, 4, 2, 0, True, 1.0)
    assert weights.dtype == torch.float32 and torch.equal(ids, ids64)
    torch.testing.assert_close(weights.double(), weights64, rtol=1e-5, atol=0)  # fp32 vs fp64 math


# ---------------------------------------------------------------------------
# 2.-4. The op vs a dense formulation, MXFP4 vs dequantized, expert parallelism.
# ---------------------------------------------------------------------------
def dense_moe(z, topk_ids, topk_weights, w13, w2, activation, beta, linear_beta):
    """Every expert on every token in fp64, combined with a dense [T, E] routing matrix
    that is zero off the top-k; h rounded once to z's dtype like the model."""
    inter = w2.shape[-1]
    gate_up = torch.einsum("tl,eil->eti", z.double(), w13.double())
    g, u = gate_up[..., :inter], gate_up[..., inter:]
    if activation == 1:
        up = linear_beta * torch.tanh(u / linear_beta) if linear_beta else u
        h = beta * torch.tanh(g / beta) * torch.sigmoid(g) * up
    else:
        h = g * torch.sigmoid(g) * u
    h = h.to(z.dtype).double()
    y = torch.einsum("eti,eli->etl", h, w2.double())
    dense = torch.zeros(z.shape[0], w13.shape[0], dtype=torch.float64)
    dense.scatter_(1, topk_ids, topk_weights.double())
    return torch.einsum("te,etl->tl", dense, y)


CASES = [  # routing, scoring, activation, situ_beta, situ_linear_beta
    (FLAT, 0, 1, 4.0, 25.0),
    (FLAT, 1, 0, 1.0, 0.0),
    (GROUPED, 0, 1, 4.0, 0.0),
    (GROUPED, 1, 1, 2.0, 3.0),
]


@pytest.mark.parametrize("routing,scoring,activation,beta,linear_beta", CASES)
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16])
def test_op_matches_dense_formulation(routing, scoring, activation, beta, linear_beta, dtype):
    x, z, router_weight, bias, w13, w2 = make_inputs(routing.num_experts, dtype, seed=21)
    a = attrs(routing, scoring=scoring, activation=activation, situ_beta=beta, situ_linear_beta=linear_beta)
    out = torch.ops.k3.situ_moe(x, z, router_weight, bias, w13, w2, *a)
    assert out.dtype == dtype and out.shape == (T, L)
    ids, weights = route(x, router_weight, bias, routing.top_k, routing.num_expert_group,
                         routing.topk_group, scoring, True, 2.5)
    ref = dense_moe(z, ids, weights, w13, w2, activation, beta, linear_beta)
    scale = ref.abs().max().item()
    # fp64: summation order only. fp32: fp32 GEMMs over 64 terms. bf16: the output's own
    # rounding (<= 2**-8 relative) plus the rare 1-ulp flip of an h element whose fp32 and
    # fp64 values straddle a bf16 rounding boundary.
    tol = {torch.float64: 1e-12, torch.float32: 1e-5, torch.bfloat16: 2 ** -7}[dtype]
    torch.testing.assert_close(out.double(), ref, rtol=tol, atol=tol * scale)
    if dtype == torch.bfloat16:
        # With h rounded once like the model, fp32 vs fp64 math only matters where a value
        # sits next to a bf16 rounding boundary: nearly all outputs agree bitwise (without
        # the rounding of h only ~60% would).
        assert (out == ref.to(dtype)).double().mean() >= 0.99


@pytest.mark.parametrize("routing", [FLAT, GROUPED])
def test_mxfp4_op_equals_op_on_dequantized_weights(routing):
    x, z, router_weight, bias, w13, w2 = make_inputs(routing.num_experts, torch.bfloat16, seed=31)
    w13_packed, w13_scale = quantize_mxfp4(w13)
    w2_packed, w2_scale = quantize_mxfp4(w2)
    a = attrs(routing)
    out = torch.ops.k3.situ_moe_mxfp4(x, z, router_weight, bias, w13_packed, w13_scale, w2_packed, w2_scale, *a)
    expected = torch.ops.k3.situ_moe(x, z, router_weight, bias, dequantize_mxfp4(w13_packed, w13_scale),
                                     dequantize_mxfp4(w2_packed, w2_scale), *a)
    assert torch.equal(out, expected)  # same bf16 weights, same path: bitwise
    # Quantization really changed the weights (the comparison is not bf16 vs bf16 itself).
    assert not torch.equal(dequantize_mxfp4(w13_packed, w13_scale), w13)


@pytest.mark.parametrize("routing", [FLAT, GROUPED])
@pytest.mark.parametrize("num_shards", [2, 4])
def test_expert_parallel_shards_sum_to_full_op(routing, num_shards):
    x, z, router_weight, bias, w13, w2 = make_inputs(routing.num_experts, torch.float64, seed=41)
    full = torch.ops.k3.situ_moe(x, z, router_weight, bias, w13, w2, *attrs(routing))
    per_shard = routing.num_experts // num_shards
    partials = []
    for shard in range(num_shards):
        local = slice(shard * per_shard, (shard + 1) * per_shard)
        partials.append(torch.ops.k3.situ_moe(x, z, router_weight, bias, w13[local], w2[local],
                                              *attrs(routing, expert_offset=local.start)))
    assert all(p.abs().max() > 0 for p in partials)  # every shard owns some selected experts
    # fp64: the shards only change the order of the fp64 sum over experts.
    torch.testing.assert_close(sum(partials), full, rtol=1e-12, atol=1e-12 * full.abs().max().item())


# ---------------------------------------------------------------------------
# 5. SiTU through the op, with identity experts so that out = glu(g, u).
# ---------------------------------------------------------------------------
def glu_through_op(g: torch.Tensor, u: torch.Tensor, activation: int, beta: float, linear_beta: float):
    """One expert, weight 1: z = [g | u], w1 picks g, w3 picks u, w2 copies h back."""
    n, width = g.shape
    z = torch.cat([g, u], dim=1)
    eye, zero = torch.eye(width, dtype=g.dtype), torch.zeros(width, width, dtype=g.dtype)
    w13 = torch.cat([torch.cat([eye, zero], 1), torch.cat([zero, eye], 1)], 0).unsqueeze(0)
    w2 = torch.cat([eye, zero], 0).unsqueeze(0)
    router_dtype = torch.float64 if g.dtype == torch.float64 else torch.float32
    x = torch.ones(n, 1, dtype=g.dtype)
    out = torch.ops.k3.situ_moe(x, z, torch.ones(1, 1, dtype=router_dtype), torch.zeros(1, dtype=router_dtype),
                                w13, w2, *attrs(Routing(1, 1), routed_scaling_factor=1.0, activation=activation,
                                                situ_beta=beta, situ_linear_beta=linear_beta))
    assert (out[:, width:] == 0).all()
    return out[:, :width]


def situ_formula(g: float, u: float, beta: float, linear_beta: float) -> float:
    gate = beta * math.tanh(g / beta) / (1 + math.exp(-g))
    return gate * (linear_beta * math.tanh(u / linear_beta) if linear_beta else u)


G_POINTS = [-50.0, -4.0, -1.0, -0.25, 0.0, 0.3125, 1.0, 2.5, 4.0, 8.0, 50.0]
U_POINTS = [-1000.0, -30.0, -25.0, -3.0, 0.0, 0.5, 7.0, 25.0, 60.0, 1000.0]


@pytest.mark.parametrize("beta,linear_beta", [(4.0, 25.0), (2.0, 0.0), (1.0, 10.0)])
def test_situ_values_match_formula(beta, linear_beta):
    pairs = [(g, u) for g in G_POINTS for u in U_POINTS]
    g = torch.tensor([[p[0] for p in pairs]], dtype=torch.float64)
    u = torch.tensor([[p[1] for p in pairs]], dtype=torch.float64)
    expected = torch.tensor([[situ_formula(a, b, beta, linear_beta) for a, b in pairs]], dtype=torch.float64)
    # fp64: libm tanh/exp vs torch's, a few ulps.
    torch.testing.assert_close(glu_through_op(g, u, 1, beta, linear_beta), expected, rtol=1e-14, atol=1e-300)
    # bf16 (all points are bf16 values): fp32 math, h rounded to bf16, y = h exactly.
    out_bf16 = glu_through_op(g.bfloat16(), u.bfloat16(), 1, beta, linear_beta)
    torch.testing.assert_close(out_bf16.double(), expected, rtol=2 ** -8, atol=0)  # one bf16 rounding
    silu = torch.tensor([[a / (1 + math.exp(-a)) * b for a, b in pairs]], dtype=torch.float64)
    torch.testing.assert_close(glu_through_op(g, u, 0, beta, linear_beta), silu, rtol=1e-14, atol=1e-300)


def test_situ_saturates():
    gen = torch.Generator().manual_seed(51)
    g = torch.cat([torch.linspace(-1e4, 1e4, 2001, dtype=torch.float64),
                   torch.randn(999, generator=gen, dtype=torch.float64) * 10]).view(1, -1)
    ones = torch.ones_like(g)
    gate = glu_through_op(g, ones, 1, 4.0, 0.0)  # up' = u = 1: the gate branch alone
    assert gate.abs().max() <= 4.0 and gate.max() == 4.0  # tanh(g/4)*sigmoid(g) -> 1
    assert gate.min() > -4.0 * 0.5  # negative gates are damped by the sigmoid
    up = glu_through_op(torch.full_like(g, 1e3), g, 1, 4.0, 25.0) / 4.0  # gate' = 4 exactly
    assert up.abs().max() <= 25.0 and up.max() == 25.0 and up.min() == -25.0


# ---------------------------------------------------------------------------
# 6. Contract conformance and input validation.
# ---------------------------------------------------------------------------
@pytest.mark.parametrize("contract,fn", [(SITU_MOE, reference.situ_moe_reference),
                                         (SITU_MOE_MXFP4, reference.situ_moe_mxfp4_reference)])
def test_reference_signature_follows_contract(contract, fn):
    names = [t.name for t in contract.inputs] + [a.name for a in contract.attrs]
    assert list(inspect.signature(fn).parameters) == names


def test_opcheck_schema_and_fake():
    x, z, router_weight, bias, w13, w2 = make_inputs(8, torch.bfloat16, seed=61)
    args = (x, z, router_weight, bias, w13, w2, *attrs(FLAT))
    torch.library.opcheck(torch.ops.k3.situ_moe.default, args)  # schema, fake fn vs real outputs
    w13q, w2q = quantize_mxfp4(w13), quantize_mxfp4(w2)
    torch.library.opcheck(torch.ops.k3.situ_moe_mxfp4.default, (x, z, router_weight, bias, *w13q, *w2q, *attrs(FLAT)))


def _bad_bf16_cases():
    """(tensor replacements, attribute overrides, expected message)."""
    _, z, router_weight, bias, w13, w2 = make_inputs(8, torch.bfloat16, seed=71)
    # w13 binds I = 80 (its first occurrence), so w2 is the one that disagrees
    yield (dict(w13=torch.zeros(8, 2 * I + 32, L, dtype=torch.bfloat16)), {},
           r"k3::situ_moe: w2: shape \[8, 64, 64\], expected \[El, L, I\] = \[8, 64, 80\] \(.*I bound by w13\)")
    yield dict(w2=w2[:7]), {}, r"k3::situ_moe: w2: shape \[7, 64, 64\], expected \[El, L, I\] = \[8, 64, 64\]"
    yield (dict(w13=w13[..., :32]), {},
           r"k3::situ_moe: w13: shape \[8, 128, 32\], expected \[El, 2\*I, L\] = \[8, 128, 64\] \(L bound by z\)")
    yield dict(w2=w2.float()), {}, r"k3::situ_moe: w2: dtype float32, expected act = bfloat16 \(.*set by x\)"
    yield dict(z=z[:-1]), {}, r"k3::situ_moe: z: shape \[19, 64\], expected \[T, L\] = \[20, L\] \(T bound by x\)"
    yield dict(z=z.float()), {}, "k3::situ_moe: z: dtype float32, expected act = bfloat16"
    yield (dict(router_weight=router_weight[:7]), {},
           r"k3::situ_moe: router_weight: shape \[7, 64\], expected \[E, D\] = \[8, 64\]")
    yield dict(router_weight=router_weight.bfloat16()), {}, "k3::situ_moe: router_weight: dtype bfloat16, expected fp32"
    yield dict(correction_bias=bias[:4]), {}, r"k3::situ_moe: correction_bias: shape \[4\], expected \[E\] = \[8\]"
    yield {}, dict(top_k=9), "top_k: expected 1 <= top_k <= num_experts = 8"
    yield dict(w13=w13[:0], w2=w2[:0]), {}, r"w13: expected at least one local expert \(El >= 1\)"
    yield {}, dict(expert_offset=1), "expert_offset: experts 1 .. 8 do not fit"
    yield {}, dict(num_experts=16), r"router_weight: shape \[8, 64\], expected \[E, D\] = \[16, 64\] \(E bound by num_experts"
    yield {}, dict(num_expert_group=4, topk_group=5), "topk_group: expected"
    yield {}, dict(num_expert_group=4, topk_group=1, top_k=3), "top_k: 3 exceeds the 2 experts"
    yield {}, dict(scoring=2), "scoring: expected 0 or 1"
    yield {}, dict(activation=3), "activation: expected 0 or 1"
    yield {}, dict(situ_beta=0.0), "situ_beta"


BAD_BF16 = list(_bad_bf16_cases())


@pytest.mark.parametrize("tensors,overrides,message", BAD_BF16, ids=[c[2][:30] for c in BAD_BF16])
def test_bad_inputs_raise_value_error(tensors, overrides, message):
    x, z, router_weight, bias, w13, w2 = make_inputs(8, torch.bfloat16, seed=71)
    inputs = dict(x=x, z=z, router_weight=router_weight, correction_bias=bias, w13=w13, w2=w2) | tensors
    routing = dict(top_k=3, num_experts=8, num_expert_group=1, topk_group=1)
    routing.update({k: overrides.pop(k) for k in list(overrides) if k in routing})
    a = attrs(Routing(routing["num_experts"], routing["top_k"], routing["num_expert_group"],
                      routing["topk_group"]), **overrides)
    with pytest.raises(ValueError, match=message):
        torch.ops.k3.situ_moe(*(inputs[t.name] for t in SITU_MOE.inputs), *a)


def test_bad_mxfp4_inputs_raise_value_error():
    x, z, router_weight, bias, w13, w2 = make_inputs(8, torch.bfloat16, seed=81)
    good = dict(zip(("w13_packed", "w13_scale"), quantize_mxfp4(w13))) | dict(
        zip(("w2_packed", "w2_scale"), quantize_mxfp4(w2)))
    cases = [
        (dict(w13_scale=good["w13_scale"][..., :1]),
         r"k3::situ_moe_mxfp4: w13_scale: shape \[8, 128, 1\], expected \[El, 2\*I, L/32\] = \[8, 128, 2\]"),
        (dict(w2_packed=good["w2_packed"].to(torch.int8)), "k3::situ_moe_mxfp4: w2_packed: dtype int8, expected uint8"),
        (dict(w13_packed=good["w13_packed"][..., :16], w13_scale=good["w13_scale"][..., :1]),
         r"w13_packed: shape \[8, 128, 16\], expected \[El, 2\*I, L/2\] = \[8, 128, 32\] \(L bound by z\)"),
        # w13_packed binds I = 64, so the shorter w2 pair disagrees
        (dict(w2_packed=good["w2_packed"][..., :16], w2_scale=good["w2_scale"][..., :1]),
         r"w2_packed: shape \[8, 64, 16\], expected \[El, L, I/2\] = \[8, 64, 32\] \(.*I bound by w13_packed\)"),
        # I = 24 has no whole number of 32-element scale groups
        (dict(w13_packed=good["w13_packed"][:, :48], w13_scale=good["w13_scale"][:, :48],
              w2_packed=good["w2_packed"][..., :12], w2_scale=good["w2_scale"][..., :1]),
         r"w2_scale: shape \[8, 64, 1\], expected \[El, L, I/32\] = \[8, 64, 0.75\]"),
    ]
    for overrides, message in cases:
        w = good | overrides
        with pytest.raises(ValueError, match=message):
            torch.ops.k3.situ_moe_mxfp4(x, z, router_weight, bias, w["w13_packed"], w["w13_scale"],
                                        w["w2_packed"], w["w2_scale"], *attrs(FLAT))
