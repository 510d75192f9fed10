"""The MLA CUDA bindings on a call their kernels do not cover (head dims, dtype, layout): the
reference op's result with one warning per distinct reason, instead of an error mid-run. The
decision is a pure function of the call, so it is checked here without the kernel library
(the bindings load it on the first kernel launch only)."""
from __future__ import annotations

import warnings

import pytest
import torch

from k3_trtllm.ops import cuda_library as kernels
from k3_trtllm.ops.mla import cuda as cuda_mla
from k3_trtllm.model.step import build_step
from k3_trtllm.ops.mla import reference as reference

BLOCK = 4


def make_call(heads, nope, rope, rank, v, dtype=torch.bfloat16, seed=0):
    """Two sequences (a chunk after a 3-token context, a fresh 3-token prompt) over a cache
    whose context rows are random; returns the op's arguments."""
    gen = torch.Generator().manual_seed(seed)
    step = build_step([([0] * 2, 3, 0, [1, 2]), ([0] * 3, 0, 0, [3])], BLOCK)
    tokens = 5
    q = torch.randn(tokens, heads, nope + rope, generator=gen).to(dtype)
    latent = torch.randn(tokens, rank + rope, generator=gen).to(dtype)
    w_uk = (torch.randn(heads, nope, rank, generator=gen) / rank ** 0.5).to(dtype)
    w_uv = (torch.randn(heads, v, rank, generator=gen) / rank ** 0.5).to(dtype)
    cache = torch.randn(5, BLOCK, rank + rope, generator=gen).to(dtype)
    return [q, latent, w_uk, w_uv, step.cu_seqlens, step.context_lens, step.block_tables, step.slot_mapping,
            cache, heads, nope, rope, rank, v, (nope + rope) ** -0.5]


@pytest.fixture
def fresh_warnings(monkeypatch):
    monkeypatch.setattr(kernels, "_warned", set())


@pytest.mark.parametrize("dims, reason", [
    ((512, 64, 128, 128), None),  # K3
    ((64, 16, 32, 32), None),  # the tiny configuration
    ((256, 64, 128, 128), "kv_lora_rank/qk_rope_head_dim (256, 64)"),
    ((512, 32, 128, 128), "kv_lora_rank/qk_rope_head_dim (512, 32)"),
    ((64, 16, 48, 32), "qk_nope_head_dim 48"),
    ((64, 16, 0, 32), "qk_nope_head_dim 0"),
    ((64, 16, 32, 12), "v_head_dim 12"),
])
def test_dims_decision_mirrors_the_kernels_supported_check(dims, reason):
    """plugins/c_api/mla.cu supported(): (rank, rope) in {(512, 64), (64, 16)}, nope a
    positive multiple of 32, v a positive multiple of 8."""
    got = cuda_mla.unsupported_dims(*dims)
    assert got is None if reason is None else got.startswith(reason), got


def test_supported_call_goes_to_the_kernels():
    args = make_call(2, 128, 64, 512, 128)
    tensors = dict(zip(("q", "latent", "w_uk", "w_uv"), args[:4]), block_tables=args[6], latent_cache=args[8])
    assert cuda_mla.unsupported(tensors, 512, 64, 128, 128) is None
    assert "dtype float32" in cuda_mla.unsupported({**tensors, "q": tensors["q"].float()}, 512, 64, 128, 128)
    wide = torch.zeros(5, 2, 400, dtype=torch.bfloat16)[:, :, :192]
    assert "non-contiguous q" in cuda_mla.unsupported({**tensors, "q": wide}, 512, 64, 128, 128)


@pytest.mark.parametrize("binding, ref", [("mla_decode_cuda", "mla_decode"), ("mla_prefill_cuda", "mla_prefill")])
def test_unsupported_dims_fall_back_to_the_reference_with_one_warning(fresh_warnings, binding, ref, recwarn):
    dims = (2, 32, 16, 32, 32)  # heads, nope, rope, kv_lora_rank 32 (no kernel), v
    args = make_call(*dims)
    want_cache = args[8].clone()
    want = getattr(reference, ref)(*args[:8], want_cache, *args[9:])
    for _ in range(3):  # every step of a model calls the op again
        got_cache = args[8].clone()
        got = getattr(cuda_mla, binding)(*args[:8], got_cache, *args[9:])
        assert torch.equal(got, want) and torch.equal(got_cache, want_cache)
    fallbacks = [w for w in recwarn if issubclass(w.category, kernels.KernelFallbackWarning)]
    assert len(fallbacks) == 1
    assert f"k3::{ref}" in str(fallbacks[0].message) and "kv_lora_rank/qk_rope_head_dim (32, 16)" in \
        str(fallbacks[0].message)

    # A second, different reason is news: it warns once more.
    other = make_call(2, 48, 16, 64, 32)
    getattr(cuda_mla, binding)(*other)
    getattr(cuda_mla, binding)(*other)
    fallbacks = [w for w in recwarn if issubclass(w.category, kernels.KernelFallbackWarning)]
    assert len(fallbacks) == 2 and "qk_nope_head_dim 48" in str(fallbacks[1].message)


def test_contract_violations_still_raise(fresh_warnings):
    args = make_call(2, 32, 16, 32, 32)
    args[1] = args[1][:, :-1]  # latent one column short
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # and no fallback warning first
        with pytest.raises(ValueError, match=r"k3::mla_decode: latent: shape \[5, 47\], expected \[T, R\+Dr\] = \[5, 48\]"):
            cuda_mla.mla_decode_cuda(*args)


def test_explicit_kernel_entries_refuse_instead_of_measuring_the_reference():
    with pytest.raises(ValueError, match="k3_mla_prefill_expanded: the CUDA kernels do not support kv_lora_rank"):
        cuda_mla.prefill_expanded(*make_call(2, 32, 16, 32, 32))
