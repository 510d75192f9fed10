"""CUDA SiTU latent-MoE kernels (plugins/c_api/moe.cu) against the fp32 reference on CPU.

Skipped without CUDA. Needs the kernel library (build_scripts/build_kernels.sh or
K3_KERNELS_LIB); the TensorRT plugin cases also need build/libk3_trt_plugins.so and
build/libk3_trt_harness.so (build_scripts/build_plugins.sh builds both).

Selection: the CUDA router's top-k sets must equal the fp32 reference's (naive.route on CPU)
for every token whose k-th and (k+1)-th biased scores differ by more than 1e-5; both sum
the logits in fp32 in different orders (a few ulps, ~1e-7 relative), so only a closer
gap could flip. Routing weights agree to 1e-5 relative.

Outputs: relative Frobenius error <= 2e-3 against the reference's bf16 output. Both sides
multiply the same bf16 operands exactly and accumulate in fp32 (different order: ~1e-6
relative), round h once to bf16 and the fp32 sum once to bf16, so they differ only where
an fp32 value sits within that ~1e-6 of a bf16 rounding boundary (one bf16 ulp, 2^-8
relative, on a small fraction of elements): ~1e-4 in practice. A wrong row, expert, tile
or weight gives O(1e-1) or more. MXFP4: the reference dequantises exactly to bf16 as the
kernel does, so the same bound holds.
"""
from __future__ import annotations

import ctypes
import os
from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")

ROOT = Path(__file__).resolve().parents[2]
TOL = 2e-3
TIE_GAP = 1e-5

# (num_experts, local experts, expert_offset, top_k, groups, topk_group, scoring, renormalize,
#  scale, activation, beta, linear_beta, L, I, D)
CASES = {
    "plain": (8, 8, 0, 3, 1, 1, 0, 1, 1.0, 1, 2.0, 4.0, 64, 64, 96),
    "grouped_softmax": (16, 16, 0, 4, 4, 2, 1, 1, 1.5, 1, 1.5, 0.0, 64, 64, 80),
    "ep_shard_silu": (16, 6, 5, 4, 1, 1, 0, 0, 2.5, 0, 1.0, 0.0, 128, 192, 64),
    # sizes the warpgroup-MMA prefill GEMMs take (L % 256 == 0, I % 128 == 0): two weight tiles
    # per expert in both GEMMs; and a down GEMM of 2 k-steps, fewer than its pipeline depth
    "wgmma_tiles": (16, 16, 0, 4, 1, 1, 0, 1, 1.0, 1, 2.0, 4.0, 512, 256, 64),
    "wgmma_ep_silu_short_k": (16, 6, 5, 4, 1, 1, 0, 0, 2.5, 0, 1.0, 0.0, 256, 128, 64),
    # 400 experts: the warp-per-token select with 16 experts per lane (decode: in the one-CTA
    # route + schedule kernel), softmax scores, an EP shard of 40 experts
    "many_experts_softmax": (400, 40, 100, 8, 1, 1, 1, 1, 1.0, 1, 2.0, 4.0, 64, 64, 96),
}
K3_CASE = (896, 112, 224, 16, 1, 1, 0, 1, 1.0, 1, 2.0, 4.0, 3584, 3072, 7168)
# One EP rank's share after the all-to-all (bench/moe_bench.py's shape): all 112 experts local.
K3_RANK_CASE = (112, 112, 0, 16, 1, 1, 0, 1, 1.0, 1, 2.0, 4.0, 3584, 3072, 7168)


@pytest.fixture(scope="module")
def cuda_moe():
    from k3_trtllm.ops.moe import cuda as moe  # registers the CUDA kernels
    return moe


def attrs_of(case):
    E, El, off, k, G, TG, scoring, renorm, scale, act, beta, lbeta = case[:12]
    return (E, k, G, TG, off, scoring, renorm, scale, act, beta, lbeta)


def make_inputs(case, T, mxfp4, seed, device="cpu", gain=1.0):
    """bf16 activations, fp32 router, bf16 or MXFP4 experts (generated on `device`). `gain`
    (a power of two) scales both expert weights up and z down, so gate/up stay O(1) while
    the MXFP4 scale bytes grow (scale-range tests); the output grows by `gain`."""
    from k3_trtllm.mxfp4 import quantize_mxfp4
    E, El, L, I, D = case[0], case[1], case[12], case[13], case[14]
    g = torch.Generator(device=device).manual_seed(seed)
    rnd = lambda *s, k=1.0: torch.randn(*s, generator=g, device=device) * k  # noqa: E731
    x = rnd(T, D).bfloat16()
    z = (rnd(T, L) / gain).bfloat16()
    router = rnd(E, D, k=D ** -0.5)
    bias = rnd(E, k=0.1)
    if not mxfp4:
        return [x, z, router, bias, rnd(El, 2 * I, L, k=L ** -0.5).bfloat16(), rnd(El, L, I, k=I ** -0.5).bfloat16()]
    if device == "cpu":
        w13 = quantize_mxfp4(rnd(El, 2 * I, L, k=L ** -0.5 * gain))
        w2 = quantize_mxfp4(rnd(El, L, I, k=I ** -0.5 * gain))
        return [x, z, router, bias, *w13, *w2]
    # K3 size: random codes and scales straight on the device (quantising 2.5e9 weights on
    # the host would dominate the test); scale bytes around 2^-6 keep gate/up O(1).
    out = [x, z, router, bias]
    for rows, cols in ((2 * I, L), (L, I)):
        out.append(torch.randint(0, 256, (El, rows, cols // 2), generator=g, device=device, dtype=torch.uint8))
        out.append(torch.randint(119, 123, (El, rows, cols // 32), generator=g, device=device, dtype=torch.uint8))
    return out


def rel_err(x, ref) -> float:
    x, ref = x.double().cpu(), ref.double().cpu()
    assert torch.isfinite(x).all(), "non-finite values"
    return float((x - ref).norm() / ref.norm().clamp_min(1e-30))


def check_selection(cuda_moe, inputs, attrs):
    """CUDA router vs naive.route (fp32, CPU): same expert sets away from near-ties, same weights."""
    from k3_trtllm.ops.moe import naive
    E, k, G, TG, _off, scoring, renorm, scale = attrs[:8]
    x, _z, router, bias = inputs[:4]
    ids, w = cuda_moe.route(x, router, bias, k, G, TG, scoring, bool(renorm), scale)
    ref_ids, ref_w = naive.route(x.cpu(), router.cpu(), bias.cpu(), k, G, TG, scoring, bool(renorm), scale)
    logits = x.cpu().float() @ router.cpu().T
    scores = torch.sigmoid(logits) if scoring == 0 else torch.softmax(logits, -1)
    sel = scores + bias.cpu()
    if naive.grouping_applies(E, G):
        sel = naive._keep_best_groups(sel, G, TG)
    top = sel.topk(min(k + 1, E), dim=-1).values
    clear = (top[:, k - 1] - top[:, k] > TIE_GAP) if k < E else torch.ones(x.shape[0], dtype=torch.bool)
    assert clear.float().mean() > 0.9, "too many near-ties to test the selection"
    got = ids.cpu().long().sort(-1).values[clear]
    want = ref_ids.sort(-1).values[clear]
    assert torch.equal(got, want), "CUDA router selected other experts than the fp32 reference"
    same = torch.equal(ids.cpu().long(), ref_ids)  # then the weights are comparable slot by slot
    if same:
        torch.testing.assert_close(w.cpu(), ref_w.float(), rtol=1e-5, atol=1e-7)
    return ref_ids, ref_w


# T*k <= 16 * E (16 rows per expert on average over all experts) takes the decode GEMMs (16-row
# tiles), above it the tiled GEMMs: 1, 7 and 40 decode (40 with experts over 16 rows in "plain",
# "grouped_softmax" and "wgmma_tiles": several decode tiles); 300 tiled but for
# "many_experts_softmax" (400 experts, 40 local: the prefill route, then the decode GEMMs). The "wgmma_*"
# cases' tiled GEMMs are the warpgroup-MMA ones, the others' the mma.sync ones. MXFP4 decode
# slabs at 1 and 7 tokens (8-row tiles): wide (16 bytes per lane and row) where K % 128 == 0
# (L 128, 256, 512; I 128, 256), narrow (8 bytes) at K 64 and 192; narrow at 40 (16-row tiles).
@pytest.mark.parametrize("mxfp4", [False, True], ids=["bf16", "mxfp4"])
@pytest.mark.parametrize("T", [1, 7, 40, 300])
@pytest.mark.parametrize("name", list(CASES))
def test_tiny_moe_matches_the_reference(cuda_moe, name, T, mxfp4):
    check_against_reference(cuda_moe, CASES[name], T, mxfp4)


@pytest.mark.parametrize("T", [7, 300])
@pytest.mark.parametrize("name", ["plain", "wgmma_tiles"])
def test_mxfp4_scales_beyond_one_bf16_factor(cuda_moe, name, T):
    """Scale bytes above 128 (2^(b-1) is no bf16): the kernels dequantise in two steps."""
    gain = 2.0 ** 12
    scale_bytes = make_inputs(CASES[name], T, True, seed=T, gain=gain)[5]
    assert int(scale_bytes.min()) > 128
    check_against_reference(cuda_moe, CASES[name], T, True, gain=gain)


@pytest.mark.parametrize("T", [1, 7])
def test_mxfp4_decode_with_unaligned_experts(cuda_moe, T):
    """Codes 8 bytes and scales 1 byte past a 16-byte boundary (contiguous views at a storage
    offset): the 8-row-tile decode GEMVs then take the narrow slabs (8-byte loads) instead of
    the wide ones (16-byte loads, which would fault), here at L 512 (two whole register stages)
    and I 256, sizes whose aligned tensors take the wide slabs."""
    case = CASES["wgmma_tiles"]
    cpu = make_inputs(case, T, True, seed=T)
    dev = [t.cuda() for t in cpu]
    for i, shift in ((4, 8), (5, 1), (6, 8), (7, 1)):
        buf = torch.empty(dev[i].numel() + 32, dtype=torch.uint8, device="cuda")
        base = (-buf.data_ptr()) % 16  # first 16-byte boundary in buf
        moved = buf[base + shift:base + shift + dev[i].numel()].view(dev[i].shape)
        moved.copy_(dev[i])
        assert moved.is_contiguous() and moved.data_ptr() % 16 == shift
        dev[i] = moved
    attrs = attrs_of(case)
    out = torch.ops.k3.situ_moe_mxfp4(*dev, *attrs)
    ref = torch.ops.k3.situ_moe_mxfp4(*cpu, *attrs)
    assert rel_err(out, ref) < TOL


@pytest.mark.parametrize("mxfp4", [False, True], ids=["bf16", "mxfp4"])
@pytest.mark.parametrize("name", ["wgmma_tiles", "wgmma_ep_silu_short_k"])
def test_prefill_tiles_match_the_reference(cuda_moe, name, mxfp4):
    """~275 rows per local expert: two full 128-row tiles and a partial one whose second
    64-row half is empty, so tile order, row masking and the idle warpgroup all show."""
    check_against_reference(cuda_moe, CASES[name], 1100, mxfp4)


def check_against_reference(cuda_moe, case, T, mxfp4, gain=1.0):
    cpu = make_inputs(case, T, mxfp4, seed=T, gain=gain)
    attrs = attrs_of(case)
    dev = [t.cuda() for t in cpu]
    ref_ids, _ = check_selection(cuda_moe, dev, attrs)
    op = torch.ops.k3.situ_moe_mxfp4 if mxfp4 else torch.ops.k3.situ_moe
    out = op(*dev, *attrs)
    ref = op(*cpu, *attrs)  # the fp32 reference (CPU dispatch)
    assert out.dtype == torch.bfloat16 and out.shape == ref.shape
    assert rel_err(out, ref) < TOL
    local = ref_ids - case[2]
    elsewhere = ~((local >= 0) & (local < case[1])).any(-1)  # all k experts on other ranks
    assert torch.equal(out.cpu()[elsewhere], torch.zeros_like(ref[elsewhere]))


@pytest.mark.parametrize("mxfp4", [False, True], ids=["bf16", "mxfp4"])
def test_k3_dims_ep_rank_matches_the_reference(cuda_moe, mxfp4):
    """K3: 896 experts top-16, this rank holds 112 (EP8 rank 2), latent 3584, I 3072."""
    from k3_trtllm.ops.moe import naive
    from k3_trtllm.mxfp4 import dequantize_mxfp4
    case, T = K3_CASE, 16
    attrs = attrs_of(case)
    dev = make_inputs(case, T, mxfp4, seed=3, device="cuda")
    ref_ids, ref_w = check_selection(cuda_moe, dev, attrs)
    op = torch.ops.k3.situ_moe_mxfp4 if mxfp4 else torch.ops.k3.situ_moe
    out = op(*dev, *attrs)
    # Reference: naive.route + naive.routed_experts on CPU over the local experts that got
    # tokens (the others contribute nothing), fp32 math; MXFP4 is dequantised exactly first.
    E, off, act, beta, lbeta = attrs[0], attrs[4], attrs[8], attrs[9], attrs[10]
    z = dev[1].cpu()
    local = ref_ids - off
    active = torch.unique(local[(local >= 0) & (local < case[1])])
    assert active.numel() > 0
    if mxfp4:
        idx = active.cuda()
        w13 = dequantize_mxfp4(dev[4][idx], dev[5][idx]).cpu()
        w2 = dequantize_mxfp4(dev[6][idx], dev[7][idx]).cpu()
    else:
        w13, w2 = dev[4][active.cuda()].cpu(), dev[5][active.cuda()].cpu()
    remap = torch.full((E,), -1, dtype=torch.long)
    remap[active + off] = torch.arange(active.numel())
    ref = naive.routed_experts(z, remap[ref_ids], ref_w, w13, w2, 0, act, beta, lbeta)
    err = rel_err(out, ref)
    print(f"K3 {'mxfp4' if mxfp4 else 'bf16'}: {active.numel()} active local experts, rel err {err:.2e}")
    assert err < TOL


@pytest.mark.parametrize("mxfp4", [False, True], ids=["bf16", "mxfp4"])
@pytest.mark.parametrize("T", [1, 2, 5])
def test_k3_ep_rank_decode_with_few_touched_experts(cuda_moe, T, mxfp4):
    """Decode as one EP8 rank sees it: 896 experts top-16, 112 local, so 1-10 local experts get
    a token. The few (tile, column block) pairs are split over K (decode_gemm.cuh split-K: the
    last CTA sums the partials in split order) and the route kernel ranks each token with
    32 / T warps (decode_route.cuh). The shard is the one holding token 0's best expert, so at
    least one local expert is touched. Output vs the fp32 reference, and bitwise equal over
    repeats (the arrival order of the split CTAs must not show)."""
    from k3_trtllm.ops.moe import naive
    from k3_trtllm.mxfp4 import dequantize_mxfp4
    base = K3_CASE
    dev = make_inputs(base, T, mxfp4, seed=11 + T, device="cuda")
    ref_ids, ref_w = naive.route(dev[0].cpu(), dev[2].cpu(), dev[3].cpu(), base[3], 1, 1, 0, True, 1.0)
    El = base[1]
    off = int(ref_ids[0, 0]) // El * El
    case = base[:2] + (off,) + base[3:]
    attrs = attrs_of(case)
    check_selection(cuda_moe, dev, attrs)
    op = torch.ops.k3.situ_moe_mxfp4 if mxfp4 else torch.ops.k3.situ_moe
    outs = [op(*dev, *attrs) for _ in range(3)]
    assert all(torch.equal(o, outs[0]) for o in outs[1:]), "repeats differ"
    local = ref_ids - off
    active = torch.unique(local[(local >= 0) & (local < El)])
    if mxfp4:
        idx = active.cuda()
        w13 = dequantize_mxfp4(dev[4][idx], dev[5][idx])
        w2 = dequantize_mxfp4(dev[6][idx], dev[7][idx])
    else:
        w13, w2 = dev[4][active.cuda()], dev[5][active.cuda()]
    remap = torch.full((case[0],), -1, dtype=torch.long)
    remap[active + off] = torch.arange(active.numel())
    allow_tf32 = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    try:
        ref = naive.routed_experts(dev[1], remap[ref_ids].cuda(), ref_w.cuda(), w13, w2, 0, *attrs[8:11])
    finally:
        torch.backends.cuda.matmul.allow_tf32 = allow_tf32
    err = rel_err(outs[0], ref)
    print(f"K3 EP rank decode T={T} {'mxfp4' if mxfp4 else 'bf16'}: {active.numel()} local experts, rel err {err:.2e}")
    assert err < TOL
    elsewhere = ~((local >= 0) & (local < El)).any(-1)
    assert torch.equal(outs[0].cpu()[elsewhere], torch.zeros_like(outs[0].cpu()[elsewhere]))


def router_logits_errors(cuda_moe, num_experts, T, D, seed):
    """Random bf16 tokens and an fp32 router of K3's scale; the CUDA router's logits and their
    absolute errors against fp64, beside those of a sequential fp32 sum over D (emulated on the
    GPU, one rounded product and one rounded add per step). Returns (case, x, router, bias,
    logits, err, err_seq)."""
    case = (num_experts, num_experts, 0, 16, 1, 1, 0, 1, 1.0, 1, 2.0, 4.0, 64, 64, D)
    g = torch.Generator(device="cuda").manual_seed(seed)
    x = torch.randn(T, D, generator=g, device="cuda").bfloat16()
    router = torch.randn(num_experts, D, generator=g, device="cuda") * D ** -0.5
    bias = torch.randn(num_experts, generator=g, device="cuda") * 0.1
    logits = torch.full((T, num_experts), float("nan"), device="cuda")
    cuda_moe.route(x, router, bias, 16, 1, 1, 0, True, 1.0, logits=logits)
    exact = x.double() @ router.double().T
    sequential = torch.zeros(T, num_experts, device="cuda")
    xf = x.float()
    for k in range(D):
        sequential += xf[:, k, None] * router[None, :, k]
    return case, x, router, bias, logits, (logits.double() - exact).abs(), (sequential.double() - exact).abs()


@pytest.mark.parametrize("num_experts,T", [(112, 1000), (896, 1000), (896, 4096), (896, 200), (112, 40)])
def test_prefill_router_logits_as_accurate_as_fp32(cuda_moe, num_experts, T):
    """Router logits on the tensor cores (router_mma.cuh, three bf16 terms of the fp32 weights)
    at K3 width D = 7168, against fp64: the error is no larger than that of a sequential fp32
    sum over D (emulated on the GPU, one rounded product and one rounded add per step), in rms
    and in max; selection equals the fp32 CPU reference's; a second call gives the same bits.
    4096 tokens at 896 experts: the wgmma kernel's 128 x 128 tiles (router_wgmma.cuh, 12-MMA
    chains); 1000 tokens: router_mma.cuh's whole-D 64 x 64 tiles (15 full 64-token tiles and a
    partial one; 112 experts: a partial second expert tile); 200 and 40 (a decode batch, T > 8):
    D split over clusters of 8 CTAs, 64-token tiles (200: a partial fourth). A two-term split
    (2^-16 per weight) would be ~10x over the rms."""
    case, x, router, bias, logits, err, err_seq = router_logits_errors(cuda_moe, num_experts, T, 7168, num_experts)
    rms, rms_seq = float(err.square().mean().sqrt()), float(err_seq.square().mean().sqrt())
    print(f"router logits E={num_experts}: rms err {rms:.2e} (sequential fp32 {rms_seq:.2e}), "
          f"max {float(err.max()):.2e} ({float(err_seq.max()):.2e})")
    assert torch.isfinite(logits).all()
    assert rms <= rms_seq and float(err.max()) <= float(err_seq.max())
    again = torch.full_like(logits, float("nan"))
    cuda_moe.route(x, router, bias, 16, 1, 1, 0, True, 1.0, logits=again)
    assert torch.equal(again, logits), "router logits differ between two identical calls"
    check_selection(cuda_moe, [x, None, router, bias], attrs_of(case))


@pytest.mark.parametrize("num_experts,T,D", [(100, 1000, 96), (100, 200, 200), (72, 520, 136), (128, 2100, 64),
                                              (256, 2050, 192)])
def test_router_logits_at_tile_and_k_edges(cuda_moe, num_experts, T, D):
    """The logits kernels' copies at every edge (router_mma.cuh's RtStageLoader, whose general
    path runs only there): D not a multiple of the 64-k stage (a part stage zero-filled past D),
    a partial last expert tile (100 = 64 + 36, 72 = 64 + 8) and token tile (1000 = 15·64 + 40,
    520 = 8·64 + 8), on the whole-D tiles (T = 1000, 520) and the D-split clusters (T = 200:
    4 stages over 8 CTAs, so some CTAs sum none). E a multiple of 128 and D of 64 from 2048
    tokens: router_wgmma.cuh's pipeline with one k-step (D = 64, its prologue alone) and three
    (D = 192), two expert tiles (256), partial token tiles (2100 = 16·128 + 52, 2050 = 16·128 + 2,
    whose rows past T are zero-filled and never stored). Against fp64; a misplaced or missing chunk
    is off by the size of a logit, far beyond twice the error of a sequential fp32 sum (the
    bound here: at D ~100 the chains' truncation is no longer small next to that sum's 100
    roundings, as it is at K3's D in the test above)."""
    case, x, router, bias, logits, err, err_seq = router_logits_errors(cuda_moe, num_experts, T, D, D)
    print(f"router logits E={num_experts} T={T} D={D}: max err {float(err.max()):.2e} "
          f"(sequential fp32 {float(err_seq.max()):.2e})")
    assert torch.isfinite(logits).all()
    assert float(err.max()) <= 2 * float(err_seq.max())
    check_selection(cuda_moe, [x, None, router, bias], attrs_of(case))


# --- TensorRT plugin through the harness (plugins/trt/harness/plugin_harness.cpp) ---------------
PLUGINS = Path(os.environ.get("K3_TRT_PLUGINS_LIB", ROOT / "build/libk3_trt_plugins.so"))
HARNESS = Path(os.environ.get("K3_TRT_HARNESS_LIB", ROOT / "build/libk3_trt_harness.so"))
# nvinfer1::DataType codes; contract "uint8" tensors are bound as INT8 (2), see export/schemas.py
TRT_DTYPE = {torch.float32: 0, torch.int32: 3, torch.uint8: 2, torch.bfloat16: 7}


def _arr(ctype, values):
    return (ctype * max(1, len(values)))(*values)


def run_plugin(contract, inputs, attrs):
    """Create / serialise / enqueue the plugin as TensorRT does; returns (out, workspace bytes)."""
    lib = ctypes.CDLL(str(HARNESS))
    lib.k3h_run.restype = ctypes.c_int
    out = torch.empty_like(inputs[1])  # [T, L] in the activation dtype
    err = ctypes.create_string_buffer(512)
    ws = ctypes.c_int64(0)
    rc = lib.k3h_run(
        str(PLUGINS).encode(), contract.plugin.encode(), len(attrs),
        _arr(ctypes.c_char_p, [a.name.encode() for a in contract.attrs]),
        _arr(ctypes.c_int, [a.kind == "float" for a in contract.attrs]), _arr(ctypes.c_double, attrs),
        len(inputs), _arr(ctypes.c_int, [TRT_DTYPE[t.dtype] for t in inputs]),
        _arr(ctypes.c_int, [t.dim() for t in inputs]), _arr(ctypes.c_int64, [d for t in inputs for d in t.shape]),
        _arr(ctypes.c_void_p, [t.data_ptr() for t in inputs]), 1, _arr(ctypes.c_int, [TRT_DTYPE[out.dtype]]),
        _arr(ctypes.c_int, [2]), _arr(ctypes.c_int64, list(out.shape)), _arr(ctypes.c_void_p, [out.data_ptr()]),
        ctypes.c_void_p(torch.cuda.current_stream().cuda_stream), ctypes.byref(ws), err, 512)
    assert rc == 0, err.value.decode()
    return out, ws.value


@pytest.mark.skipif(not (PLUGINS.exists() and HARNESS.exists()), reason="plugin library / harness not built")
@pytest.mark.parametrize("mxfp4", [False, True], ids=["bf16", "mxfp4"])
def test_trt_plugin_matches_the_reference(cuda_moe, mxfp4):
    from k3_trtllm.ops import contract as C
    case, T = CASES["ep_shard_silu"], 37
    cpu = make_inputs(case, T, mxfp4, seed=11)
    attrs = attrs_of(case)
    contract = C.SITU_MOE_MXFP4 if mxfp4 else C.SITU_MOE
    out, ws = run_plugin(contract, [t.cuda() for t in cpu], attrs)
    ref = getattr(torch.ops.k3, contract.name)(*cpu, *attrs)
    assert rel_err(out, ref) < TOL
    E, El, L, I = case[0], case[1], case[12], case[13]
    assert ws == cuda_moe._LIB.k3_moe_workspace_size(T, E, attrs[1], El, L, I) > 0


@pytest.mark.parametrize("mxfp4", [False, True], ids=["bf16", "mxfp4"])
def test_k3_dims_prefill_matches_the_reference(cuda_moe, mxfp4):
    """K3 sizes in the prefill GEMMs: 1024 tokens top-16 over one rank's 112 experts (~146 rows
    each: a full and a partial 128-row tile), latent 3584, I 3072."""
    check_k3_rank(cuda_moe, 1024, mxfp4, seed=5, what="prefill")


@pytest.mark.parametrize("mxfp4", [False, True], ids=["bf16", "mxfp4"])
@pytest.mark.parametrize("T", [1, 8, 64])
def test_k3_dims_decode_matches_the_reference(cuda_moe, T, mxfp4):
    """K3 sizes in the decode GEMVs (bench/moe_bench.py's decode cases): 1 and 8 tokens take the
    8-row tiles (one n8 MMA tile), 64 tokens the 16-row tiles with every one of the 112 experts
    touched; MXFP4 through the table lookups and the two register stages (whole stages cover
    L 3584 and I 3072), with the wide slabs (16 bytes per lane and row) at 1 and 8 tokens and
    the narrow ones (8 bytes) at 64, scale bytes 119-122."""
    check_k3_rank(cuda_moe, T, mxfp4, seed=7 + T, what="decode")


@pytest.mark.parametrize("mxfp4", [False, True], ids=["bf16", "mxfp4"])
@pytest.mark.parametrize("T", [1024, 4096])
def test_k3_dims_ep8_prefill_matches_the_reference(cuda_moe, T, mxfp4):
    """Prefill as one EP8 rank sees it (the rank slice): 896 experts top-16, this rank's 112
    (offset 224) get ~T·16/8 rows, ~18 (T = 1024) or ~73 (T = 4096) per expert on average, so
    the MXFP4 GEMMs (tokens on N) run column tiles of many widths (N = the tile's rows rounded up
    to 16); 7/8 of the slots belong to other ranks."""
    check_k3_rank(cuda_moe, T, mxfp4, seed=13 + T, what="EP8 prefill", case=K3_CASE)


def check_k3_rank(cuda_moe, T, mxfp4, seed, what, case=K3_RANK_CASE):
    """One rank's 112 experts at K3 dims (K3_RANK_CASE, or `case`). Reference: naive.route on CPU, then
    naive.routed_experts in fp32 on the GPU (cuBLAS with TF32 off; fp32 products of the same
    bf16 operands, so the module's 2e-3 bound holds). On the CPU the reference GEMMs over
    7.4 GB of weights would take minutes."""
    from k3_trtllm.ops.moe import naive
    from k3_trtllm.mxfp4 import dequantize_mxfp4
    attrs = attrs_of(case)
    dev = make_inputs(case, T, mxfp4, seed=seed, device="cuda")
    ref_ids, ref_w = check_selection(cuda_moe, dev, attrs)
    op = torch.ops.k3.situ_moe_mxfp4 if mxfp4 else torch.ops.k3.situ_moe
    out = op(*dev, *attrs)
    w13, w2 = (dequantize_mxfp4(*dev[4:6]), dequantize_mxfp4(*dev[6:8])) if mxfp4 else dev[4:6]
    allow_tf32 = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    try:
        ref = naive.routed_experts(dev[1], ref_ids.cuda(), ref_w.cuda(), w13, w2, case[2], *attrs[8:11])
    finally:
        torch.backends.cuda.matmul.allow_tf32 = allow_tf32
    err = rel_err(out, ref)
    print(f"K3 {what} T={T} {'mxfp4' if mxfp4 else 'bf16'}: rel err {err:.2e}")
    assert err < TOL
