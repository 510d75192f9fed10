"""The skinny bf16 linear (plugins/include/k3/linear/, ops/linear) on the H200 against the exact
(fp64) product, at the decode projections of a K3 TP8 rank (o_proj 7168 x 1536, the shared
experts' down 7168 x 768, latent_up 7168 x 3584, KDA in_proj 6284 x 7168, f_b 1536 x 128, the
LM head 20480 x 7168 in fp32) and a small odd one.

Tolerance: the kernel sums in fp32 in its own order and rounds once, as cuBLAS does in another;
an element is within one bf16 ulp of the exact value (half from the rounding, the fp32 sum's
error far below the other half; plus 2^-20 of sum |x w| where the sum cancels to near zero), and
>= 99% of the elements are the exact value's bf16 rounding bitwise, which a wrong row, token or
weight cannot pass. fp32 output: 2^-16 of sum |x w|.

Skipped without CUDA or without the kernel library (build_scripts/build_kernels.sh)."""
from __future__ import annotations

import pytest
import torch

from k3_trtllm.ops.cuda_library import library_path

pytestmark = [
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
    pytest.mark.skipif(not library_path().exists(), reason=f"kernel library {library_path()} not built"),
]

SHAPES = [(7168, 1536), (7168, 768), (7168, 3584), (6284, 7168), (1536, 128), (24, 40)]


def _rand(*shape, seed, scale=1.0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    return (torch.randn(*shape, generator=g, device="cuda") * scale).to(torch.bfloat16)


def _ulp(t: torch.Tensor) -> torch.Tensor:
    """One bf16 ulp at each element of the fp64 tensor ``t``."""
    return torch.ldexp(torch.ones_like(t), torch.frexp(t.abs().clamp_min(2.0 ** -126)).exponent - 8)


@pytest.mark.parametrize("tokens", [1, 2, 3, 4])
@pytest.mark.parametrize("n,k", SHAPES)
def test_skinny_linear_is_within_one_ulp_of_the_exact_product(tokens, n, k):
    from k3_trtllm.ops.linear import cuda
    x, w = _rand(tokens, k, seed=n + k), _rand(n, k, seed=k, scale=k ** -0.5)
    got = cuda.linear(x, w)
    exact = x.double() @ w.double().T
    assert got.dtype == torch.bfloat16 and got.shape == (tokens, n)
    slack = 2.0 ** -20 * (x.double().abs() @ w.double().abs().T)  # the fp32 sum's error where it cancels
    assert ((got.double() - exact).abs() <= _ulp(exact) + slack).all()
    assert (got == exact.to(torch.bfloat16)).double().mean() >= 0.99


def test_fp32_output_for_the_lm_head():
    from k3_trtllm.ops.linear import cuda
    x, w = _rand(2, 7168, seed=1), _rand(20480, 7168, seed=2, scale=7168 ** -0.5)
    got = cuda.linear(x, w, out_fp32=True)
    exact = x.double() @ w.double().T
    assert got.dtype == torch.float32
    scale = (x.double().abs() @ w.double().abs().T).max().item()
    torch.testing.assert_close(got.double(), exact, rtol=0, atol=2.0 ** -16 * scale)


def test_a_tokens_bits_do_not_depend_on_the_batch_or_its_row_stride():
    """A weight-streaming warp per feature, in an order fixed by K: the rows of a call of 4
    tokens are bitwise the rows alone, also when the rows are a strided view (split columns)."""
    from k3_trtllm.ops.linear import cuda
    wide = _rand(4, 1536 + 64, seed=5)
    x = wide[:, 64:]  # row stride 1600 (a multiple of 8), 128-byte offset
    w = _rand(7168, 1536, seed=6, scale=1536 ** -0.5)
    batch = cuda.linear(x, w)
    for t in range(4):
        assert torch.equal(batch[t:t + 1].view(torch.int16), cuda.linear(x[t:t + 1].contiguous(), w).view(torch.int16))


def test_dispatch_takes_the_kernel_for_few_tokens_only():
    """ops.linear: one launch of the skinny kernel for a decode-sized call; torch's linear
    (bitwise) past MAX_TOKENS, for unaligned rows and for fp32."""
    from torch.nn import functional as F

    from k3_trtllm.ops import linear as ops_linear
    w = _rand(7168, 1536, seed=7, scale=1536 ** -0.5)
    x = _rand(1, 1536, seed=8)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        y = ops_linear.linear(x, w)
        torch.cuda.synchronize()
    kernels = [e.name for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    assert len(kernels) == 1 and "skinny_linear_kernel" in kernels[0], kernels
    assert torch.equal(y, ops_linear.cuda.linear(x, w))
    many = _rand(ops_linear.cuda.MAX_TOKENS + 1, 1536, seed=9)
    assert torch.equal(ops_linear.linear(many, w), F.linear(many, w))
    odd = _rand(2, 1540, seed=10)[:, 2:1538]  # rows 4 bytes off 16
    assert torch.equal(ops_linear.linear(odd, w), F.linear(odd, w))
    x32 = x.float()
    assert torch.equal(ops_linear.linear(x32, w.float()), F.linear(x32, w.float()))


def test_refuses_calls_outside_its_limits():
    """The launcher's own checks (the binding never makes such calls): cudaErrorInvalidValue (1)."""
    import ctypes

    from k3_trtllm.ops.linear import cuda
    assert cuda.available()
    x, w = _rand(1, 64, seed=11), _rand(8, 64, seed=12)
    out = torch.empty(1, 8, dtype=torch.bfloat16, device="cuda")
    stream = torch.cuda.current_stream().cuda_stream
    for bad in ({"tokens": cuda.MAX_TOKENS + 1}, {"k": 60}, {"out_fp32": 2}):
        fields = dict(x=x.data_ptr(), x_row_stride=64, weight=w.data_ptr(), out=out.data_ptr(), tokens=1, n=8, k=64,
                      out_fp32=0) | bad
        assert cuda._library().k3_skinny_linear(ctypes.byref(cuda.SkinnyLinearParams(**fields)), stream) == 1
