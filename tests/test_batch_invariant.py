"""The batch-invariant mode's torch overrides (k3_trtllm/ops/batch_invariant.py), checked
on the CPU dispatch key (the mode registers them for CUDA, where tests/gpu/test_determinism.py
runs them on the H200): every overridden op computes what torch computes (to rounding), and a
row's bits do not depend on how many rows share the call."""
from __future__ import annotations

import contextlib

import pytest
import torch

from k3_trtllm.ops import batch_invariant as bi


@contextlib.contextmanager
def cpu_overrides():
    lib = bi._install("CPU")
    try:
        yield
    finally:
        lib._destroy()


@pytest.fixture(autouse=True)
def small_blocks(monkeypatch):
    monkeypatch.setattr(bi, "CHUNK_ROWS", 16)  # several blocks and a padded tail at small sizes


def _ops(x, w, v, bias, s):
    lin = torch.nn.functional.linear
    return {"mm": x @ w.t(), "linear_bias": lin(x, w, bias), "linear_3d": lin(x.view(2, -1, x.shape[1]), w),
            "addmm_row_bias": torch.addmm(x[:, :w.shape[0]].contiguous(), x, w.t(), beta=0.5, alpha=2.0),
            "mv": x @ v, "mean_last": x.pow(2).mean(-1, keepdim=True), "mean_first": x.mean(0),
            "sum_last": x.sum(-1), "softmax_first": torch.softmax(s, 0), "softmax_last": torch.softmax(x, -1),
            "mean_all": x.mean(), "bf16_linear": lin(x.bfloat16(), w.bfloat16())}


def _inputs(rows, seed=0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(rows, 24, generator=g), torch.randn(12, 24, generator=g), torch.randn(24, generator=g),
            torch.randn(12, generator=g), torch.randn(3, rows, generator=g))


def test_overrides_compute_what_torch_computes():
    args = _inputs(50)
    ref = _ops(*args)
    with cpu_overrides():
        got = _ops(*args)
    for name, r in ref.items():
        assert got[name].shape == r.shape and got[name].dtype == r.dtype, name
        tol = 2e-2 if r.dtype == torch.bfloat16 else 1e-5
        assert torch.allclose(got[name].float(), r.float(), rtol=tol, atol=tol), name


def test_a_row_gets_the_same_bits_alone_and_in_any_batch():
    x, w, v, _, _ = _inputs(50, seed=1)
    with cpu_overrides():
        batched = {"mm": x @ w.t(), "mv": x @ v, "norm": x.pow(2).mean(-1), "softmax": torch.softmax(x, -1)}
        for i in (0, 15, 16, 37, 49):
            for lo, hi in ((i, i + 1), (max(0, i - 20), i + 1), (0, 50)):
                part = x[lo:hi].clone()
                alone = {"mm": part @ w.t(), "mv": part @ v, "norm": part.pow(2).mean(-1),
                         "softmax": torch.softmax(part, -1)}
                for name, a in alone.items():
                    assert torch.equal(a[i - lo], batched[name][i]), (name, i, lo, hi)


def test_the_mode_needs_the_cuda_kernel_library(monkeypatch, tmp_path):
    monkeypatch.setenv("K3_KERNELS_LIB", str(tmp_path / "missing.so"))
    with pytest.raises(RuntimeError, match="batch-invariant mode needs the CUDA kernel library"):
        bi.set_batch_invariant(True)
    assert not bi.batch_invariant()
