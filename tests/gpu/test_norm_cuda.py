"""The residual-stream kernels (plugins/include/k3/norm/, ops/norm/cuda.py) against their fp32
references (ops/common.py, ops/norm/reference.py) on the H200, at K3's dims (hidden 7168, KDA
head_dim 128 with K3's in_proj row stride 6284, 9 AttnRes sources) and the tiny model's.

Tolerance: each kernel does the reference's fp32 math in another summation order and rounds its
bf16 output once, so an element is within one bf16 ulp of the exact (fp64) value: half an ulp
from the rounding, plus fp32 accumulation-order effects ~1e-6 relative, far below the other
half. The AttnRes mix sums sources of different scales, so where an element nearly cancels, the
fp32 rounding of its terms (~2^-24 of sum_s w_s |v_s|, the reference's as much as the kernel's)
exceeds its own ulp: there the bound adds 2^-16 of that magnitude (still 2^-7 of half a bf16
ulp of the terms). The final mix is rounded to bf16 before the norm (as the model does), so
there two roundings can each go the other way than the fp32 reference's: 2 ulps against it.
Every comparison also asks >= 99% of the elements to be bitwise the reference's bf16, which a
systematic error (wrong eps, a missing weight or gate, a wrong row) cannot pass.

Then the tiny K3 on CUDA: a decode step launches fewer kernels with the fused kernels than with
the torch reference forms (counts printed: the before/after of issue 20 item 3), and the rows of
a batch are bitwise the rows of the same tokens alone (batch invariance of every fused kernel).

Skipped without CUDA or without the kernel library (build_scripts/build_kernels.sh)."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

from k3_trtllm.ops import common
from k3_trtllm.ops.cuda_library import library_path

ROOT = Path(__file__).resolve().parents[2]
TINY = ROOT / "examples" / "tiny-k3"
EPS = 1e-5

pytestmark = [
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
    pytest.mark.skipif(not library_path().exists(), reason=f"kernel library {library_path()} not built"),
]


def _ulp(v: torch.Tensor) -> torch.Tensor:
    """Spacing of bf16 (8 significant bits) at |v|, the smallest normal's at 0."""
    a = v.abs().clamp_min(torch.finfo(torch.bfloat16).tiny)
    return torch.exp2(torch.floor(torch.log2(a)) - 7)


def _assert_close(got: torch.Tensor, exact: torch.Tensor, ref_bf16: torch.Tensor, ulps: float = 1.0,
                  atol: torch.Tensor | float = 0.0) -> None:
    assert got.dtype == torch.bfloat16 and got.shape == exact.shape, (got.dtype, got.shape, exact.shape)
    err = ((got.double() - exact.double()).abs() - atol).clamp_min(0) / _ulp(exact.double())
    assert float(err.max()) <= ulps, f"max error {float(err.max()):.3f} bf16 ulps (bound {ulps})"
    same = float((got.view(torch.int16) == ref_bf16.view(torch.int16)).double().mean())
    assert same >= 0.99, f"only {same:.4f} of the elements are the reference's bf16"


def _rand(*shape, scale=1.0, seed=0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    return (torch.randn(*shape, generator=g, device="cuda") * scale).to(torch.bfloat16)


@pytest.mark.parametrize("weight_dtype", [torch.bfloat16, torch.float32, None])
@pytest.mark.parametrize("tokens,dim,row_stride", [(1, 7168, 7168), (37, 7168, 7168), (128, 512, 2112),
                                                    (5, 64, 272), (300, 30, 30)])
def test_rms_norm_matches_the_reference(tokens, dim, row_stride, weight_dtype):
    """Rows of a wider product (the MLA's c_kv / c_q split views) and contiguous ones; the
    widths pick each vector width (8, 4, 2 bf16)."""
    from k3_trtllm.ops.norm import cuda
    buf = _rand(tokens, row_stride, seed=tokens)
    x = buf[:, row_stride - dim:]
    w = None if weight_dtype is None else (1 + 0.1 * _rand(dim, seed=1).float()).to(weight_dtype)
    got = cuda.rms_norm(x, w, EPS)
    exact = common.rms_norm(x.double(), None if w is None else w.double(), EPS)
    _assert_close(got, exact, common.rms_norm(x, w, EPS))


@pytest.mark.parametrize("tokens,heads,head_dim,row_stride", [(1, 12, 128, 6284), (64, 12, 128, 6284),
                                                              (9, 4, 32, 548)])
def test_gated_rms_norm_matches_the_reference(tokens, heads, head_dim, row_stride):
    """K3's KDA output norm: o [T, H, Dk] contiguous, the gate a strided view of in_proj's product
    (row stride 6284 = 4 P + Dk + H: 8-byte aligned rows, so the 4-wide loads)."""
    from k3_trtllm.ops.norm import cuda
    P = heads * head_dim
    o = _rand(tokens, heads, head_dim, seed=2)
    gate = _rand(tokens, row_stride, scale=2.0, seed=3)[:, 3 * P: 4 * P].reshape(tokens, heads, head_dim)
    w = 1 + 0.1 * _rand(head_dim, seed=4)
    got = cuda.gated_rms_norm(o, w, gate, EPS)
    exact = common.gated_rms_norm(o.double(), w.double(), gate.double(), EPS)
    _assert_close(got, exact, common.gated_rms_norm(o, w, gate, EPS))


def _sources(n, tokens, dim, seed):
    return [_rand(tokens, dim, scale=1 + i, seed=seed + i) for i in range(n)]


def _cancellation_atol(sources: list[torch.Tensor], query: torch.Tensor, norm_weight: torch.Tensor) -> torch.Tensor:
    """2^-16 of each normed output element's sum_s w_s |v_s| (fp64; see the module docstring)."""
    from k3_trtllm.ops import attn_res
    v = [s.double() for s in sources]
    w = torch.softmax(torch.stack([attn_res.source_logits(s, query.double(), EPS) for s in v]), 0)
    mix = sum(wi[:, None] * s for wi, s in zip(w, v))
    magnitude = sum(wi[:, None] * s.abs() for wi, s in zip(w, v))
    return 2.0 ** -16 * magnitude * torch.rsqrt(mix.pow(2).mean(-1, keepdim=True) + EPS) * norm_weight.double().abs()


@pytest.mark.parametrize("residual", [True, False])
@pytest.mark.parametrize("n,tokens,dim", [(1, 3, 7168), (3, 1, 7168), (9, 128, 7168), (5, 17, 128), (2, 4, 36)])
def test_attn_res_mix_norm_matches_the_reference(n, tokens, dim, residual):
    from k3_trtllm.ops.norm import cuda, reference
    sources = _sources(n, tokens, dim, seed=10 * n)
    res = _rand(tokens, dim, seed=99) if residual else None
    query = (0.05 * _rand(dim, seed=7)).float()
    w = 1 + 0.1 * _rand(dim, seed=8)
    got, partial = cuda.attn_res_mix_norm(sources, res, query, EPS, w, EPS)
    ref, ref_partial = reference.attn_res_mix_norm(sources, res, query, EPS, w, EPS)
    assert torch.equal(partial.view(torch.int16), ref_partial.view(torch.int16))  # bf16(P + a), both
    exact, _ = reference.attn_res_mix_norm([s.double() for s in sources[:-1]] + [ref_partial.double()], None,
                                           query.double(), EPS, w.double(), EPS)
    _assert_close(got, exact, ref, atol=_cancellation_atol(sources[:-1] + [ref_partial], query, w))


@pytest.mark.parametrize("n,tokens,dim", [(16, 2, 7168), (8, 3, 7168), (4, 2, 7168), (3, 2, 7166), (2, 2, 10238),
                                          (9, 2, 10240), (5, 3, 1000), (3, 2, 520)])
def test_attn_res_mix_norm_row_splits_match_the_reference(n, tokens, dim):
    """The row split over a cluster of CTAs at other widths and source counts: every vector width
    (7166 and 10238 take 2-wide vectors; two vectors per thread at 10238 and up to 3 sources), a
    last CTA short of its share (7166, 1000), clusters of fewer than 8 CTAs (1000, 520), and a full
    set of sources (16)."""
    test_attn_res_mix_norm_matches_the_reference(n, tokens, dim, True)


@pytest.mark.parametrize("n,dim", [(16, 7168), (4, 7168), (3, 7166), (2, 10238), (9, 10240), (5, 1000), (3, 520)])
def test_many_token_rows_match_the_reference_and_the_rows_alone(n, dim):
    """From 128 tokens on, one CTA per token does the cluster's sums in the cluster's order: the
    reference at the row-split widths, and each row bitwise as in a decode-sized batch."""
    from k3_trtllm.ops.norm import cuda
    tokens = 160
    test_attn_res_mix_norm_matches_the_reference(n, tokens, dim, True)
    sources = _sources(n, tokens, dim, seed=10 * n)
    res = _rand(tokens, dim, seed=99)
    query, w = (0.05 * _rand(dim, seed=7)).float(), 1 + 0.1 * _rand(dim, seed=8)
    batch, batch_partial = cuda.attn_res_mix_norm(sources, res, query, EPS, w, EPS)
    for lo, hi in ((0, 1), (100, 160)):
        part, part_partial = cuda.attn_res_mix_norm([s[lo:hi] for s in sources], res[lo:hi], query, EPS, w, EPS)
        assert torch.equal(batch[lo:hi].view(torch.int16), part.view(torch.int16))
        assert torch.equal(batch_partial[lo:hi].view(torch.int16), part_partial.view(torch.int16))


@pytest.mark.parametrize("n", [2, 9])
def test_mix_rows_do_not_depend_on_the_batch_size(n):
    """A row's bits are the same in a prefill-sized batch as alone or in a decode batch (the
    cluster split is fixed by the width and the source count alone; an odd batch leaves the last
    CTA of two tokens one), for the mix and the final norm of its rows."""
    from k3_trtllm.ops.norm import cuda
    tokens = 4095
    sources = _sources(n, tokens, 7168, seed=80)
    routed, shared = _rand(tokens, 7168, seed=81), _rand(tokens, 7168, seed=82)
    query, w = (0.05 * _rand(7168, seed=83)).float(), 1 + 0.1 * _rand(7168, seed=84)
    batch, batch_partial = cuda.attn_res_mix_norm(sources, (routed, shared), query, EPS, w, EPS)
    rows = torch.tensor([tokens - 1, 7, 2048], dtype=torch.int32, device="cuda")
    final = cuda.attn_res_final_norm(sources, (routed, shared), query, EPS, rows, w, EPS)
    for lo, hi in ((7, 8), (tokens - 32, tokens)):
        part, part_partial = cuda.attn_res_mix_norm([s[lo:hi] for s in sources], (routed[lo:hi], shared[lo:hi]),
                                                    query, EPS, w, EPS)
        assert torch.equal(batch[lo:hi].view(torch.int16), part.view(torch.int16))
        assert torch.equal(batch_partial[lo:hi].view(torch.int16), part_partial.view(torch.int16))
        alone = cuda.attn_res_final_norm([s[lo:hi] for s in sources], (routed[lo:hi], shared[lo:hi]), query, EPS,
                                         torch.tensor([hi - lo - 1], dtype=torch.int32, device="cuda"), w, EPS)
        assert torch.equal(final[0 if hi == tokens else 1].view(torch.int16), alone[0].view(torch.int16))


def test_attn_res_final_norm_matches_the_reference_on_its_rows():
    from k3_trtllm.ops.norm import cuda, reference
    sources = _sources(9, 64, 7168, seed=50)
    res = _rand(64, 7168, seed=51)
    query = (0.05 * _rand(7168, seed=52)).float()
    w = 1 + 0.1 * _rand(7168, seed=53)
    rows = torch.tensor([63, 0, 17, 17, 5], dtype=torch.int32, device="cuda")
    got = cuda.attn_res_final_norm(sources, res, query, EPS, rows, w, EPS)
    ref = reference.attn_res_final_norm(sources, res, query, EPS, rows, w, EPS)
    atol = _cancellation_atol(sources[:-1] + [sources[-1] + res], query, w)[rows.long()]
    _assert_close(got, ref.double(), ref, ulps=2.0, atol=atol)


def test_operands_the_kernels_cannot_read_safely_go_to_the_reference(monkeypatch):
    """A weight shorter than the rows or an operand on another device would be read by the kernel
    as if valid (out of bounds, or a foreign pointer that breaks the CUDA context): such calls
    go to the reference, which raises its own error."""
    from k3_trtllm.ops import cuda_library
    from k3_trtllm.ops.norm import cuda
    monkeypatch.setattr(cuda_library, "_warned", set())
    x = _rand(4, 256, seed=70)
    with pytest.warns(cuda_library.KernelFallbackWarning, match="weight of length 128 for rows of 256"):
        with pytest.raises(RuntimeError):
            cuda.rms_norm(x, torch.ones(128, device="cuda"), EPS)
    with pytest.warns(cuda_library.KernelFallbackWarning, match="up on cpu"):
        with pytest.raises(RuntimeError):
            cuda.glu(_rand(4, 256, seed=71), _rand(4, 256, seed=72).cpu(), 0, 0.0, 0.0)
    torch.cuda.synchronize()


@pytest.mark.parametrize("tokens", [1, 8, 33])
def test_a_residual_of_two_terms_is_their_bf16_sum(tokens):
    """The latent MoE hands the mixes its routed and shared outputs as two terms (one add kernel
    fewer per layer): the kernel's partial sum must be bf16(P + bf16(routed + shared)), bitwise the
    reference's, and its outputs bitwise the kernel's own for the pre-added sub-layer output."""
    from k3_trtllm.ops.norm import cuda, reference
    sources = _sources(4, tokens, 7168, seed=70)
    routed, shared = _rand(tokens, 7168, seed=71), 0.5 * _rand(tokens, 7168, seed=72)
    query = (0.05 * _rand(7168, seed=73)).float()
    w = 1 + 0.1 * _rand(7168, seed=74)
    got, partial = cuda.attn_res_mix_norm(sources, (routed, shared), query, EPS, w, EPS)
    _, ref_partial = reference.attn_res_mix_norm(sources, (routed, shared), query, EPS, w, EPS)
    want, want_partial = cuda.attn_res_mix_norm(sources, routed + shared, query, EPS, w, EPS)
    assert torch.equal(partial.view(torch.int16), ref_partial.view(torch.int16))
    assert torch.equal(partial.view(torch.int16), want_partial.view(torch.int16))
    assert torch.equal(got.view(torch.int16), want.view(torch.int16))
    rows = torch.tensor([tokens - 1, 0], dtype=torch.int32, device="cuda")
    final = cuda.attn_res_final_norm(sources, (routed, shared), query, EPS, rows, w, EPS)
    assert torch.equal(final.view(torch.int16),
                       cuda.attn_res_final_norm(sources, routed + shared, query, EPS, rows, w, EPS).view(torch.int16))


def test_calls_with_no_rows_return_empty_outputs():
    """A prefill chunk that samples no token asks the final norm for no rows (every chunk the
    prefix cache cuts at a snapshot position): an empty result, not a launch error, even though
    torch gives the empty row list and output null data pointers."""
    from k3_trtllm.ops.norm import cuda, reference
    sources = _sources(3, 16, 7168, seed=60)
    res = _rand(16, 7168, seed=61)
    query = (0.05 * _rand(7168, seed=62)).float()
    w = 1 + 0.1 * _rand(7168, seed=63)
    rows = torch.empty(0, dtype=torch.int32, device="cuda")
    got = cuda.attn_res_final_norm(sources, res, query, EPS, rows, w, EPS)
    assert got.shape == reference.attn_res_final_norm(sources, res, query, EPS, rows, w, EPS).shape == (0, 7168)
    x = _rand(0, 7168, seed=64)
    assert cuda.rms_norm(x, w, EPS).shape == (0, 7168)
    torch.cuda.synchronize()


@pytest.mark.parametrize("activation,linear_beta", [(1, 25.0), (1, 0.0), (0, 0.0)])
@pytest.mark.parametrize("tokens,inter", [(1, 3072), (33, 3072), (7, 64)])
def test_glu_matches_the_reference(tokens, inter, activation, linear_beta):
    """The two halves of the fc product [T, 2 inter] (SiTU with and without the up clip, SiLU)."""
    from k3_trtllm.ops.norm import cuda
    fc = _rand(tokens, 2 * inter, scale=4.0, seed=inter + tokens)
    g, u = fc.split(inter, -1)
    got = cuda.glu(g, u, activation, 4.0, linear_beta)
    exact = common.glu(g.double(), u.double(), activation, 4.0, linear_beta)
    _assert_close(got, exact, common.glu(g, u, activation, 4.0, linear_beta))


@pytest.mark.parametrize("tokens,width,row_stride", [(1, 1536, 3648), (40, 128, 272)])
def test_sigmoid_gate_matches_the_reference(tokens, width, row_stride):
    """The MLA output gate: the attention output (contiguous) times sigmoid of gate columns of
    fused_a's product (K3's row stride 3648 and the tiny model's 272)."""
    from k3_trtllm.ops.norm import cuda, reference
    o = _rand(tokens, width, seed=70)
    gate = _rand(tokens, row_stride, scale=3.0, seed=71)[:, row_stride - width:]
    got = cuda.sigmoid_gate(o, gate)
    exact = o.double() * torch.sigmoid(gate.double())
    _assert_close(got, exact, reference.sigmoid_gate(o, gate))


def test_fused_rows_are_bitwise_the_rows_alone():
    """Each row reduced in an order fixed by the width and the source count (RMSNorm: one CTA; the
    mix: a cluster of CTAs over the row): a row's bits do not depend on the batch."""
    from k3_trtllm.ops.norm import cuda
    sources = _sources(4, 32, 7168, seed=60)
    res = _rand(32, 7168, seed=61)
    query, w = (0.05 * _rand(7168, seed=62)).float(), 1 + 0.1 * _rand(7168, seed=63)
    batch, _ = cuda.attn_res_mix_norm(sources, res, query, EPS, w, EPS)
    alone, _ = cuda.attn_res_mix_norm([s[9:10] for s in sources], res[9:10], query, EPS, w, EPS)
    assert torch.equal(batch[9:10].view(torch.int16), alone.view(torch.int16))
    assert torch.equal(cuda.rms_norm(res, w, EPS)[9:10].view(torch.int16),
                       cuda.rms_norm(res[9:10], w, EPS).view(torch.int16))


def _decode_launches(model, caches, step) -> tuple[int, set[str]]:
    with torch.inference_mode():
        model(step, caches, decode=True)
        torch.cuda.synchronize()
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
            logits = model(step, caches, decode=True)
            torch.cuda.synchronize()
    assert torch.isfinite(logits).all()
    kernels = [e.name for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    return len(kernels), set(kernels)


def test_tiny_k3_decode_step_launches_fewer_kernels(monkeypatch):
    """Before (the torch reference forms: norms, mixes and GLU as torch kernels, the projections
    as torch's linear, the LM head upcast to fp32) and after, on the same decode step of 4
    sequences."""
    from k3_trtllm.model import build_step, k3, load_model
    from k3_trtllm.ops import norm
    from k3_trtllm.ops.linear import cuda as linear_cuda
    model = load_model(TINY, dtype=torch.bfloat16, device="cuda")
    caches = model.allocate_caches(8, 16, 4)
    step = build_step([([5 + i], 20 + i, i, [2 * i, 2 * i + 1]) for i in range(4)], 16).to("cuda")
    after, names = _decode_launches(model, caches, step)
    assert any("k3::norm::attn_res_mix_norm_kernel" in n for n in names), sorted(names)
    monkeypatch.setattr(norm, "_available", False)
    monkeypatch.setattr(k3, "_mm_out_dtype_runs", lambda _device_type: False)
    monkeypatch.setattr(linear_cuda, "_available", False)  # the projections and head as torch's too
    before, names_before = _decode_launches(model, caches, step)
    assert not any("k3::norm" in n for n in names_before)
    layers = model.config.num_hidden_layers
    print(f"\ntiny K3 decode step (4 seqs, {layers} layers): {before} launches with the torch forms, {after} with "
          f"the fused kernels ({before / layers:.1f} -> {after / layers:.1f} per layer)")
    assert after < 0.6 * before
