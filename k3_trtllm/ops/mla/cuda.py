"""CUDA implementations of ``k3::mla_prefill`` and ``k3::mla_decode`` (ctypes over
``libk3_kernels.so``, sources in ``plugins/c_api/mla.cu``).

Importing this module registers both kernels for CUDA tensors; the library loads on the
first kernel call. They take bf16, contiguous, 16-byte aligned tensors and the head dims of
``mla.cu``'s ``supported()``; any other call (the fp32/fp64 exactness checks, a model with
other dims) runs the reference op, with one warning per distinct reason (``unsupported``
decides, without the library). Decode runs the exact absorbed form (insert latents,
q_nope·W_UK, MQA over the paged latent cache, ·W_UV). Prefill runs the expanded form (per-head
K/V expanded from the cached latents in bounded passes, causal flash attention) when the step
has >= 384 new tokens per sequence on average, else the absorbed form; both cover chunked
prefill.

The fp8 twins ``k3::mla_decode_fp8`` / ``k3::mla_prefill_fp8`` run the same launchers over the
byte cache of fp8_cache.py: the insert writes the quantiser's bytes, the attention kernels
dequantise on load. They also need a power-of-two ``scale_group`` (every Q dividing the K3 and
tiny ranks) and rows of a multiple of 16 bytes (K3's 656; the tiny model's 100-byte rows run
the reference op).
"""
from __future__ import annotations

import ctypes

import torch

from .. import registry
from ..c_abi import MLA, MLA_FP8
from ..contract import MLA_DECODE, MLA_DECODE_FP8, MLA_PREFILL, MLA_PREFILL_FP8
from . import fp8_cache
from . import reference as _reference  # importing defines the k3::mla_* ops
from ..cuda_library import check, fall_back, load_library, unsupported_tensors

SUPPORTED_DIMS = ((512, 64), (64, 16))  # (kv_lora_rank, qk_rope_head_dim)

_p, _i, _f, _sz = ctypes.c_void_p, ctypes.c_int, ctypes.c_float, ctypes.c_size_t
_LIB: ctypes.CDLL | None = None


def _lib() -> ctypes.CDLL:
    """The kernel library with its argument types set, loaded on first use so that the
    dispatch decision (and the fallback) work on machines without it."""
    global _LIB
    if _LIB is None:
        lib = load_library()
        for names, params in ((("k3_mla_decode", "k3_mla_prefill", "k3_mla_prefill_expanded"), MLA),
                              (("k3_mla_decode_fp8", "k3_mla_prefill_fp8", "k3_mla_prefill_expanded_fp8"), MLA_FP8)):
            for name in names:
                fn = getattr(lib, name)
                fn.argtypes = [ctypes.POINTER(params.structure), _p]  # const K3Mla[Fp8]Params*, stream
                fn.restype = _i
        lib.k3_mla_workspace_size.argtypes = [_i] * 5
        lib.k3_mla_workspace_size.restype = _sz
        for fp8 in ("", "_fp8"):
            getattr(lib, f"k3_mla_prefill{fp8}_workspace_size").argtypes = [_i] * 9
            getattr(lib, f"k3_mla_prefill{fp8}_workspace_size").restype = _sz
            getattr(lib, f"k3_mla_prefill_expanded{fp8}_workspace_size").argtypes = [_i] * 10
            getattr(lib, f"k3_mla_prefill_expanded{fp8}_workspace_size").restype = _sz
            getattr(lib, f"k3_mla_prefill{fp8}_uses_expanded").argtypes = [_i] * 9 + [_sz]
            getattr(lib, f"k3_mla_prefill{fp8}_uses_expanded").restype = _i
        lib.k3_mla_latent_attention.argtypes = [_p] * 7 + [_i] * 8 + [_f, _p, _sz, _p]
        lib.k3_mla_latent_attention.restype = _i
        lib.k3_mla_latent_attention_fp8.argtypes = [_p] * 7 + [_i] * 8 + [_f, _i, _p, _sz, _p]
        lib.k3_mla_latent_attention_fp8.restype = _i
        _LIB = lib
    return _LIB


def _require(ok: bool, message: str) -> None:
    if not ok:
        raise ValueError(message)


def unsupported_dims(kv_lora_rank: int, qk_rope_head_dim: int, qk_nope_head_dim: int, v_head_dim: int) -> str | None:
    """Why the kernels cannot run these head dims, or None when they can (``supported()`` in
    plugins/c_api/mla.cu, which returns cudaErrorInvalidValue for anything else)."""
    if (kv_lora_rank, qk_rope_head_dim) not in SUPPORTED_DIMS:
        return (f"kv_lora_rank/qk_rope_head_dim {(kv_lora_rank, qk_rope_head_dim)} "
                f"(built for {' or '.join(map(str, SUPPORTED_DIMS))})")
    if qk_nope_head_dim <= 0 or qk_nope_head_dim % 32:
        return f"qk_nope_head_dim {qk_nope_head_dim} (needs a positive multiple of 32)"
    if v_head_dim <= 0 or v_head_dim % 8:
        return f"v_head_dim {v_head_dim} (needs a positive multiple of 8)"
    return None


def unsupported_fp8(kv_lora_rank: int, qk_rope_head_dim: int, scale_group: int) -> str | None:
    """Why the kernels cannot run the fp8 cache of these dims, beyond ``unsupported_dims``
    (``fp8_supported()`` in plugins/c_api/mla.cu), or None when they can."""
    if scale_group <= 0 or scale_group & (scale_group - 1) or kv_lora_rank % scale_group or scale_group % 16:
        return f"scale_group {scale_group} (needs a power of two >= 16 dividing kv_lora_rank {kv_lora_rank})"
    row = fp8_cache.row_bytes(kv_lora_rank, qk_rope_head_dim, scale_group)
    if row % 16:
        return f"fp8 latent rows of {row} bytes (needs a multiple of 16)"
    return None


def unsupported(tensors: dict[str, torch.Tensor], kv_lora_rank: int, qk_rope_head_dim: int,
                qk_nope_head_dim: int, v_head_dim: int, scale_group: int | None = None) -> str | None:
    """Why ``k3::mla_decode`` / ``k3::mla_prefill`` (``scale_group`` given: their fp8 twins) run
    the reference op for a call, or None when the kernels take it: the dispatch decision, a pure
    function of the call."""
    floats = {n: torch.bfloat16 for n in ("q", "latent", "w_uk", "w_uv", "latent_cache")}
    if scale_group is not None:
        floats["latent_cache"] = torch.uint8
    return (unsupported_tensors({n: t for n, t in tensors.items() if n in floats}, floats)
            or unsupported_dims(kv_lora_rank, qk_rope_head_dim, qk_nope_head_dim, v_head_dim)
            or (unsupported_fp8(kv_lora_rank, qk_rope_head_dim, scale_group) if scale_group is not None else None)
            or unsupported_tensors({n: t for n, t in tensors.items() if n not in floats}, {}))


def _workspace(num_tokens: int, num_heads: int, rank: int, block_tables: torch.Tensor,
               block_size: int, device: torch.device) -> torch.Tensor:
    size = _lib().k3_mla_workspace_size(num_tokens, num_heads, rank, block_tables.shape[1], block_size)
    return torch.empty(max(size, 1), dtype=torch.uint8, device=device)


def _sizes(q, context_lens, block_tables, latent_cache, num_heads, qk_nope_head_dim, qk_rope_head_dim,
           kv_lora_rank, v_head_dim) -> tuple[int, ...]:
    """The size arguments of the prefill workspace queries, in their order."""
    return (q.shape[0], context_lens.shape[0], num_heads, qk_nope_head_dim, qk_rope_head_dim, kv_lora_rank,
            v_head_dim, block_tables.shape[1], latent_cache.shape[1])


def _run(contract, entry_name, reference, workspace_bytes, q, latent, w_uk, w_uv, cu_seqlens, context_lens,
         block_tables, slot_mapping, latent_cache, num_heads, qk_nope_head_dim, qk_rope_head_dim, kv_lora_rank,
         v_head_dim, softmax_scale, *scale_group, **extras):
    """Check the call against ``contract`` (a violation raises on every path); run
    ``reference`` or, when it is None (an explicit kernel entry), raise where the kernels
    cannot take the call; else
    allocate out and ``workspace_bytes(lib, *sizes)`` of workspace and call the C entry with
    ``extras``, the K3Mla[Fp8]Params fields beyond the contract (c_abi.EXTRAS). ``scale_group``
    (one value) is the fp8 contracts' last attribute."""
    args = (q, latent, w_uk, w_uv, cu_seqlens, context_lens, block_tables, slot_mapping, latent_cache,
            num_heads, qk_nope_head_dim, qk_rope_head_dim, kv_lora_rank, v_head_dim, softmax_scale, *scale_group)
    contract.check(*args)
    reason = unsupported({"q": q, "latent": latent, "w_uk": w_uk, "w_uv": w_uv, "block_tables": block_tables,
                          "latent_cache": latent_cache}, kv_lora_rank, qk_rope_head_dim, qk_nope_head_dim,
                         v_head_dim, *scale_group)
    if reason is not None:
        _require(reference is not None, f"{entry_name}: the CUDA kernels do not support {reason}")
        return fall_back(contract.name, reason, reference, *args)
    # the kernels index these 1-D lists densely (a strided view would read, and write the cache
    # at, the wrong slots); the contract requires contiguity only of what is updated in place
    cu_seqlens, context_lens = cu_seqlens.contiguous(), context_lens.contiguous()
    slot_mapping = slot_mapping.contiguous()
    num_tokens, num_seqs = q.shape[0], context_lens.shape[0]
    out = torch.empty((num_tokens, num_heads * v_head_dim), dtype=q.dtype, device=q.device)
    if num_tokens == 0:
        return out
    lib = _lib()
    sizes = _sizes(q, context_lens, block_tables, latent_cache, num_heads, qk_nope_head_dim, qk_rope_head_dim,
                   kv_lora_rank, v_head_dim)
    with torch.cuda.device(q.device):  # the launcher sizes splits for, and launches on, the current device
        ws = torch.empty(max(workspace_bytes(lib, *sizes), 1), dtype=torch.uint8, device=q.device)
        launch = (MLA_FP8 if scale_group else MLA).fill(
            (q, latent, w_uk, w_uv, cu_seqlens, context_lens, block_tables, slot_mapping, latent_cache), (out,),
            (num_heads, qk_nope_head_dim, qk_rope_head_dim, kv_lora_rank, v_head_dim, softmax_scale, *scale_group),
            ws, ws.numel(), **extras)
        status = getattr(lib, entry_name)(ctypes.byref(launch), torch.cuda.current_stream(q.device).cuda_stream)
    check(status, entry_name)
    return out


def _decode_workspace(lib, num_tokens, num_seqs, num_heads, nope, rope, rank, v_dim, max_blocks, block_size):
    return lib.k3_mla_workspace_size(num_tokens, num_heads, rank, max_blocks, block_size)


def _prefill_workspace(lib, *sizes):
    return lib.k3_mla_prefill_workspace_size(*sizes)


def mla_decode_cuda(*args) -> torch.Tensor:
    return _run(MLA_DECODE, "k3_mla_decode", _reference.mla_decode, _decode_workspace, *args)


def mla_prefill_cuda(*args) -> torch.Tensor:
    return _run(MLA_PREFILL, "k3_mla_prefill", _reference.mla_prefill, _prefill_workspace, *args)


def mla_decode_fp8_cuda(*args) -> torch.Tensor:
    return _run(MLA_DECODE_FP8, "k3_mla_decode_fp8", _reference.mla_decode_fp8, _decode_workspace, *args)


def mla_prefill_fp8_cuda(*args) -> torch.Tensor:
    return _run(MLA_PREFILL_FP8, "k3_mla_prefill_fp8", _reference.mla_prefill_fp8,
                lambda lib, *sizes: lib.k3_mla_prefill_fp8_workspace_size(*sizes), *args)


def prefill_expanded(*args, key_chunk: int = 0) -> torch.Tensor:
    """``k3::mla_prefill``'s arguments (with a 16th, ``scale_group``: ``k3::mla_prefill_fp8``'s),
    always through the expanded form (tests, benchmarks), with passes of ``key_chunk`` keys (0:
    the default cap). Raises where the kernels cannot take the call: a test of the expanded
    form must not measure the reference instead."""
    fp8 = "_fp8" if len(args) == 16 else ""

    def workspace_bytes(lib, *sizes):
        size = getattr(lib, f"k3_mla_prefill_expanded{fp8}_workspace_size")(*sizes, key_chunk)
        _require(size > 0, "prefill_expanded: these head dims or sizes are not supported by the expanded form")
        return size
    return _run(MLA_PREFILL_FP8 if fp8 else MLA_PREFILL, f"k3_mla_prefill_expanded{fp8}", None, workspace_bytes,
                *args, key_chunk=key_chunk)


def prefill_uses_expanded(num_tokens: int, num_seqs: int, num_heads: int, qk_nope_head_dim: int,
                          qk_rope_head_dim: int, kv_lora_rank: int, v_head_dim: int, max_blocks: int,
                          block_size: int, fp8: bool = False) -> bool:
    """Whether ``k3::mla_prefill`` (``fp8``: ``k3::mla_prefill_fp8``) takes the expanded form for
    these sizes (its own workspace)."""
    sizes = (num_tokens, num_seqs, num_heads, qk_nope_head_dim, qk_rope_head_dim, kv_lora_rank, v_head_dim,
             max_blocks, block_size)
    lib, tag = _lib(), "_fp8" if fp8 else ""
    return bool(getattr(lib, f"k3_mla_prefill{tag}_uses_expanded")(
        *sizes, getattr(lib, f"k3_mla_prefill{tag}_workspace_size")(*sizes)))


def latent_attention(q_lat: torch.Tensor, q: torch.Tensor, cu_seqlens: torch.Tensor, context_lens: torch.Tensor,
                     block_tables: torch.Tensor, latent_cache: torch.Tensor, qk_nope_head_dim: int,
                     softmax_scale: float, scale_group: int | None = None) -> torch.Tensor:
    """The attention part alone (no cache insert, no W_UK / W_UV): ``a_lat [T, H, R]``
    from ``q_lat [T, H, R]`` and ``q_pe = q[..., qk_nope_head_dim:]`` (bf16), over the bf16
    cache or, with ``scale_group``, the fp8 one (uint8 rows). An explicit kernel entry: raises
    where the kernels cannot take the call."""
    num_tokens, num_heads, rank = q_lat.shape
    rope = q.shape[2] - qk_nope_head_dim
    fp8 = scale_group is not None
    reason = (unsupported_dims(rank, rope, qk_nope_head_dim, 8)
              or (unsupported_fp8(rank, rope, scale_group) if fp8 else None)
              or unsupported_tensors({"q_lat": q_lat, "q": q, "block_tables": block_tables,
                                      "latent_cache": latent_cache},
                                     {"q_lat": torch.bfloat16, "q": torch.bfloat16,
                                      "latent_cache": torch.uint8 if fp8 else torch.bfloat16}))
    _require(reason is None, f"latent_attention: the CUDA kernels do not support {reason}")
    a_lat = torch.empty_like(q_lat)
    block_size = latent_cache.shape[1]
    with torch.cuda.device(q.device):
        ws = _workspace(num_tokens, num_heads, rank, block_tables, block_size, q.device)
        head = (q_lat.data_ptr(), q.data_ptr(), cu_seqlens.data_ptr(), context_lens.data_ptr(),
                block_tables.data_ptr(), latent_cache.data_ptr(), a_lat.data_ptr(), num_tokens, context_lens.shape[0],
                block_tables.shape[1], block_size, num_heads, qk_nope_head_dim, rope, rank, float(softmax_scale))
        tail = (ws.data_ptr(), ws.numel(), torch.cuda.current_stream(q.device).cuda_stream)
        name = "k3_mla_latent_attention_fp8" if fp8 else "k3_mla_latent_attention"
        status = getattr(_lib(), name)(*head, *((scale_group,) if fp8 else ()), *tail)
    check(status, name)
    return a_lat


registry.register_kernel(MLA_DECODE, "CUDA", mla_decode_cuda)
registry.register_kernel(MLA_PREFILL, "CUDA", mla_prefill_cuda)
registry.register_kernel(MLA_DECODE_FP8, "CUDA", mla_decode_fp8_cuda)
registry.register_kernel(MLA_PREFILL_FP8, "CUDA", mla_prefill_fp8_cuda)
