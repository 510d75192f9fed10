"""The decode route past 16 tokens (decode_route.cuh): T CTAs select each token's experts with
8 warps (route_select_group_kernel), then the one-CTA route_schedule_kernel counts, scans and
scatters that selection instead of selecting with one warp per token.

K3's router (896 experts, top-16, sigmoid) at one EP8 rank (112 local, offset 224) and at one
rank's all-local share (112 experts), T = 17 (the first T past the few-token path), 32 and 64
(the largest decode route), and 128: the prefill route, then at the EP rank the decode GEMVs
(moe.cu counts rows per expert over all E: ~2.3 per local expert), all-local the tiled GEMMs.
Outputs against the fp32 reference with the fp32 reference's own selection
(test_moe_cuda.check_k3_rank: a wrong expert, weight or row is an O(1e-1) error against the
2e-3 bound), and bitwise equal over repeats. Softmax scores keep the one-warp path
(test_moe_cuda's "many_experts_softmax" at T = 40).

The router alone (k3_moe_route) selects with the same 8-warp group up to 1024 tokens and with one
warp per token past that (moe.cu kGroupSelectMaxRows); both must give the same ids and weight bits,
or a token's routing would depend on how many tokens share its step.
"""
from __future__ import annotations

import pytest
import torch

from test_moe_cuda import K3_CASE, K3_RANK_CASE, attrs_of, check_k3_rank, make_inputs

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


@pytest.fixture(scope="module")
def cuda_moe():
    from k3_trtllm.ops.moe import cuda as moe  # registers the CUDA kernels
    return moe


@pytest.mark.parametrize("case", ["ep8_rank", "all_local"])
@pytest.mark.parametrize("T", [17, 32, 64, 128])
def test_preselected_decode_route_matches_the_reference(cuda_moe, T, case):
    moe_case = K3_CASE if case == "ep8_rank" else K3_RANK_CASE
    check_k3_rank(cuda_moe, T, True, seed=29 + T, what=f"decode route {case}", case=moe_case)


@pytest.mark.parametrize("T", [17, 64, 128])
def test_preselected_decode_route_repeats_bitwise(cuda_moe, T):
    dev = make_inputs(K3_CASE, T, True, seed=41 + T, device="cuda")
    attrs = attrs_of(K3_CASE)
    outs = [torch.ops.k3.situ_moe_mxfp4(*dev, *attrs) for _ in range(3)]
    assert all(torch.equal(o, outs[0]) for o in outs[1:]), "repeats differ"


@pytest.mark.parametrize("num_experts", [896, 112])
def test_group_and_warp_selection_give_the_same_bits(cuda_moe, num_experts):
    # 1024 tokens take the group select, 1100 the one-warp select; both have T > 384, so their
    # logits come from the same whole-D kernel, whose rows do not depend on T (checked below too)
    D = 7168
    g = torch.Generator(device="cuda").manual_seed(53 + num_experts)
    x = torch.randn(1100, D, generator=g, device="cuda").bfloat16()
    router = torch.randn(num_experts, D, generator=g, device="cuda") * D ** -0.5
    bias = torch.randn(num_experts, generator=g, device="cuda") * 0.1
    logits_group = torch.empty(1024 * num_experts, device="cuda")
    logits_warp = torch.empty(1100 * num_experts, device="cuda")
    ids_g, w_g = cuda_moe.route(x[:1024], router, bias, 16, 1, 1, 0, True, 2.5, logits=logits_group)
    ids_w, w_w = cuda_moe.route(x, router, bias, 16, 1, 1, 0, True, 2.5, logits=logits_warp)
    assert torch.equal(logits_group, logits_warp[: 1024 * num_experts]), "the logits rows depend on T"
    assert torch.equal(ids_g, ids_w[:1024]), "the two selections chose other experts or another order"
    assert torch.equal(w_g, w_w[:1024]), "the two selections' weights differ in bits"
