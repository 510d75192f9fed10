"""H200 harness: the TensorRT plugins of libk3_trt_plugins.so driven like TensorRT drives them.

``plugins/trt/harness/plugin_harness.cpp`` (C ABI, ctypes) loads the library, finds each
creator through ``getCreators()``, creates the plugin from PluginFields (build phase for
dtypes / formats / workspace, then runtime phase from ``getFieldsToSerialize()`` as plan
deserialisation does, then ``attachToContext``), calls ``onShapeChange`` and ``enqueue``
with torch device buffers. Outputs and updated pools are compared with the fp32 reference
ops on CPU copies. Pools are bound in place (the executor's way) and, in one case each,
to separate output buffers (the plugin must copy first).

Tolerances (relative Frobenius error) are the kernels' own, documented in
tests/gpu/test_kda_cuda.py and tests/gpu/test_mla_cuda.py: KDA chunked out 1e-2 / state
5e-3 (bf16 tensor-core operands + bf16 output), KDA recurrent out 2e-3 / state 1e-4, MLA 1e-2 with
a bit-exact latent cache. Needs build/libk3_trt_plugins.so and build/libk3_trt_harness.so
(K3_TRT_PLUGINS_LIB / K3_TRT_HARNESS_LIB override), both built by
    TENSORRT_INCLUDE_DIR=$PWD/third_party/tensorrt/include build_scripts/build_plugins.sh build"""
from __future__ import annotations

import ctypes
import os
from pathlib import Path

import pytest
import torch

if not torch.cuda.is_available():
    pytest.skip("needs a CUDA device", allow_module_level=True)

from k3_trtllm.export.schemas import node_outputs  # noqa: E402
from k3_trtllm.ops import contract as C  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
PLUGINS = Path(os.environ.get("K3_TRT_PLUGINS_LIB", ROOT / "build/libk3_trt_plugins.so"))
HARNESS = Path(os.environ.get("K3_TRT_HARNESS_LIB", ROOT / "build/libk3_trt_harness.so"))
if not PLUGINS.exists() or not HARNESS.exists():
    pytest.skip("build the plugin library and the harness first (build_scripts/build_plugins.sh)", allow_module_level=True)

# nvinfer1::DataType codes; contract "uint8" tensors are bound as INT8 (2), see export/schemas.py
TRT_DTYPE = {torch.float32: 0, torch.float16: 1, torch.int32: 3, torch.uint8: 2, torch.bfloat16: 7}
_lib = ctypes.CDLL(str(HARNESS))
_lib.k3h_run.restype = ctypes.c_int


def _arr(ctype, values):
    return (ctype * max(1, len(values)))(*values)


_kernels = ctypes.CDLL(str(ROOT / "build/libk3_kernels.so"))
_kernels.k3_kda_prefill_workspace_bytes.argtypes = [ctypes.c_int] * 4 + [ctypes.c_float]
_kernels.k3_kda_prefill_workspace_bytes.restype = ctypes.c_size_t


def kda_prefill_workspace_bytes(T: int, B: int, H: int, K: int, lower_bound: float) -> int:
    return _kernels.k3_kda_prefill_workspace_bytes(T, B, H, K, lower_bound)


def run_plugin(contract: C.OpContract, inputs: list[torch.Tensor], attrs: tuple, in_place: bool = True):
    """Enqueue the plugin; returns its outputs (contract outputs, then updated pools)."""
    bound = {}
    for spec, t in zip(contract.inputs, inputs):
        for sym, d in zip(spec.shape, t.shape):
            bound.setdefault(sym, d)
    pool_inputs = {f"{t.name}_out": i for i, t in enumerate(contract.inputs) if t.mutated}
    outs = []
    for spec in node_outputs(contract):
        if spec.name in pool_inputs:
            src = inputs[pool_inputs[spec.name]]
            outs.append(src if in_place else torch.full_like(src, float("nan")))
        else:  # the activation output, e.g. [T, P] or [T, H*Dv]
            shape = [bound[sym] if sym in bound else bound[sym.split("*")[0]] * bound[sym.split("*")[1]]
                     for sym in spec.shape]
            outs.append(torch.empty(shape, dtype=inputs[0].dtype, device="cuda"))
    err = ctypes.create_string_buffer(512)
    ws = ctypes.c_int64(0)
    dims_in = [d for t in inputs for d in t.shape]
    dims_out = [d for t in outs for d in t.shape]
    stream = torch.cuda.current_stream().cuda_stream
    rc = _lib.k3h_run(
        str(PLUGINS).encode(), contract.plugin.encode(), len(attrs),
        _arr(ctypes.c_char_p, [a.name.encode() for a in contract.attrs]),
        _arr(ctypes.c_int, [a.kind == "float" for a in contract.attrs]), _arr(ctypes.c_double, attrs),
        len(inputs), _arr(ctypes.c_int, [TRT_DTYPE[t.dtype] for t in inputs]),
        _arr(ctypes.c_int, [t.dim() for t in inputs]), _arr(ctypes.c_int64, dims_in),
        _arr(ctypes.c_void_p, [t.data_ptr() for t in inputs]),
        len(outs), _arr(ctypes.c_int, [TRT_DTYPE[t.dtype] for t in outs]),
        _arr(ctypes.c_int, [t.dim() for t in outs]), _arr(ctypes.c_int64, dims_out),
        _arr(ctypes.c_void_p, [t.data_ptr() for t in outs]), ctypes.c_void_p(stream), ctypes.byref(ws), err, 512)
    assert rc == 0, err.value.decode()
    return outs, ws.value


def rel_err(x, ref) -> float:
    x, ref = x.double().cpu(), ref.double().cpu()
    assert torch.isfinite(x).all(), "non-finite values"
    return float((x - ref).norm() / ref.norm().clamp_min(1e-30))


def kda_case(lengths, H=4, K=64, W=4, lower_bound=-5.0, seed=0):
    g = torch.Generator().manual_seed(seed)
    P, B, T = H * K, len(lengths), sum(lengths)
    pool = B + 3
    rnd = lambda *s, k=1.0: torch.randn(*s, generator=g) * k  # noqa: E731
    cu = torch.tensor([0] + torch.tensor(lengths).cumsum(0).tolist(), dtype=torch.int32)
    inputs = [rnd(T, 3 * P).bfloat16(), rnd(T, P, k=2.0).bfloat16(), rnd(T, H, k=2.0).bfloat16(),
              rnd(3 * P, W, k=0.6), rnd(H, k=0.5), rnd(P, k=0.5), cu,
              torch.randperm(pool, generator=g)[:B].to(torch.int32),
              torch.tensor([i % 2 for i in range(B)], dtype=torch.int32),
              rnd(pool, 3 * P, W - 1).bfloat16(), rnd(pool, H, K, K, k=0.3),
              # no prefix-cache snapshot points: one -1 column, one-row snapshot pools
              torch.full((B, 1), -1, dtype=torch.int32), torch.zeros(B, 1, dtype=torch.int32),
              rnd(1, 3 * P, W - 1).bfloat16(), rnd(1, H, K, K)]
    return inputs, (H, K, lower_bound)


@pytest.mark.parametrize("plugin, lengths, in_place, tol", [
    (C.KDA_PREFILL, [70, 1, 130, 5], True, (1e-2, 5e-3)),    # chunked kernel
    (C.KDA_PREFILL, [1, 1, 1], True, (2e-3, 1e-4)),          # T == B: the plugin picks the recurrence
    (C.KDA_DECODE, [1, 3, 1, 2], True, (2e-3, 1e-4)),
    (C.KDA_DECODE, [1, 1], False, (2e-3, 1e-4)),              # separate pool outputs: copy then update
])
def test_kda_plugins_match_the_reference(plugin, lengths, in_place, tol):
    cpu, attrs = kda_case(lengths)
    dev = [t.cuda() for t in cpu]
    before = [t.clone() for t in dev[9:11]]
    outs, ws = run_plugin(plugin, dev, attrs, in_place)
    ref_pools = [t.clone() for t in cpu[9:11]]
    ref = torch.ops.k3.kda_decode(*cpu[:9], *ref_pools, *cpu[11:], *attrs)
    # The prefill plugin reserves the chunked kernel's workspace for the shape (the size the
    # kernel library reports); the decode plugin needs none.
    T, B, (H, K, lb) = cpu[0].shape[0], cpu[6].shape[0] - 1, attrs
    assert ws == (kda_prefill_workspace_bytes(T, B, H, K, lb) if plugin is C.KDA_PREFILL else 0)
    assert rel_err(outs[0], ref) < tol[0]
    touched = cpu[7].long()
    assert torch.equal(outs[1].cpu()[touched], ref_pools[0][touched])  # raw inputs copied: exact
    assert rel_err(outs[2].cpu()[touched], ref_pools[1][touched]) < tol[1]
    untouched = torch.ones(cpu[9].shape[0], dtype=torch.bool)
    untouched[touched] = False
    for new, old in zip(outs[1:3], before):
        assert torch.equal(new[untouched.cuda()], old[untouched.cuda()])
    assert torch.equal(outs[3].cpu(), cpu[13]) and torch.equal(outs[4].cpu(), cpu[14])  # no points: unchanged


def mla_case(contexts, new_tokens, H=4, nope=32, rope=16, rank=64, v=32, block_size=16, seed=0):
    g = torch.Generator().manual_seed(seed)
    totals = [c + n for c, n in zip(contexts, new_tokens)]
    per_seq = [max(1, -(-t // block_size)) for t in totals]
    pool = sum(per_seq) + 5
    perm = torch.randperm(pool, generator=g).to(torch.int32)
    tables = torch.zeros(len(contexts), max(per_seq), dtype=torch.int32)
    used = 0
    for b, nb in enumerate(per_seq):
        tables[b, :nb] = perm[used:used + nb]
        used += nb
    slots = torch.cat([tables[b, torch.arange(c, c + n) // block_size].long() * block_size
                       + torch.arange(c, c + n) % block_size for b, (c, n) in enumerate(zip(contexts, new_tokens))])
    T = sum(new_tokens)
    bf = torch.bfloat16
    inputs = [torch.randn(T, H, nope + rope, generator=g).to(bf), torch.randn(T, rank + rope, generator=g).to(bf),
              (torch.randn(H, nope, rank, generator=g) / nope ** 0.5).to(bf),
              (torch.randn(H, v, rank, generator=g) / rank ** 0.5).to(bf),
              torch.tensor([0] + torch.tensor(new_tokens).cumsum(0).tolist(), dtype=torch.int32),
              torch.tensor(contexts, dtype=torch.int32), tables, slots.to(torch.int32),
              torch.randn(pool, block_size, rank + rope, generator=g).to(bf)]
    return inputs, (H, nope, rope, rank, v, (nope + rope) ** -0.5)


@pytest.mark.parametrize("plugin, contexts, new_tokens, in_place", [
    (C.MLA_PREFILL, [0, 37, 5], [20, 9, 1], True),
    (C.MLA_DECODE, [40, 3, 17], [1, 1, 1], True),
    (C.MLA_DECODE, [12, 64], [1, 1], False),
])
def test_mla_plugins_match_the_reference(plugin, contexts, new_tokens, in_place):
    cpu, attrs = mla_case(contexts, new_tokens)
    outs, ws = run_plugin(plugin, [t.cuda() for t in cpu], attrs, in_place)
    ref_cache = cpu[8].clone()
    ref = getattr(torch.ops.k3, plugin.name)(*cpu[:8], ref_cache, *attrs)
    assert rel_err(outs[0], ref) < 1e-2
    assert torch.equal(outs[1].cpu(), ref_cache)
    assert ws > 0
