"""The residual-stream ops (k3_trtllm/ops/norm): the ctypes params structs lay their fields out
where a C compiler lays out k3/norm_api.h's, and off CUDA every op is its reference, bitwise
(the composition of common / attn_res ops the model ran before the fused kernels existed)."""
from __future__ import annotations

import ctypes
import shutil
import subprocess
from pathlib import Path

import pytest
import torch

from k3_trtllm.ops import attn_res, common, norm
from k3_trtllm.ops.norm import cuda

ROOT = Path(__file__).resolve().parents[1]
STRUCTS = {"K3RmsNormParams": cuda.RmsNormParams, "K3AttnResMixParams": cuda.AttnResMixParams,
           "K3GluParams": cuda.GluParams}


@pytest.mark.parametrize("compiler,suffix", [("gcc", "c"), ("g++", "cpp")])
def test_ctypes_structs_match_the_c_header(compiler, suffix, tmp_path):
    if shutil.which(compiler) is None:
        pytest.skip(f"{compiler} not installed")
    lines = ["#include <stdio.h>", "#include <stddef.h>", "#include \"k3/norm_api.h\"", "int main(void) {"]
    expected = []
    for name, struct in STRUCTS.items():
        lines.append(f'  printf("{name} sizeof %zu\\n", sizeof({name}));')
        expected.append(f"{name} sizeof {ctypes.sizeof(struct)}")
        for field, _ in struct._fields_:
            lines.append(f'  printf("{name} {field} %zu\\n", offsetof({name}, {field}));')
            expected.append(f"{name} {field} {getattr(struct, field).offset}")
    lines += ["  return 0;", "}"]
    src, exe = tmp_path / f"norm_abi.{suffix}", tmp_path / "norm_abi"
    src.write_text("\n".join(lines) + "\n")
    # the header includes cuda_runtime.h only for cudaStream_t: a stand-in keeps the check toolkit-free
    (tmp_path / "cuda_runtime.h").write_text("typedef struct CUstream_st* cudaStream_t;\n")
    subprocess.run([compiler, "-I", str(tmp_path), "-I", str(ROOT / "plugins/include"), str(src), "-o", str(exe)],
                   check=True)
    assert subprocess.run([str(exe)], check=True, capture_output=True, text=True).stdout.splitlines() == expected
    header = (ROOT / "plugins/include/k3/norm_api.h").read_text()
    assert f"#define K3_ATTN_RES_MAX_SOURCES {cuda.MAX_SOURCES}" in header
    assert f"#define K3_ATTN_RES_MAX_DIM {cuda.MAX_MIX_DIM}" in header
    assert f"#define K3_GLU_SIGMOID_GATE {cuda.SIGMOID_GATE}" in header


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view({2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()])


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.float64])
def test_off_cuda_every_op_is_its_reference_bitwise(dtype):
    g = torch.Generator().manual_seed(0)
    T, d = 5, 64

    def rand(*shape, scale=1.0):
        return (torch.randn(*shape, generator=g) * scale).to(dtype)
    blocks, partial, a = [rand(T, d, scale=2.0), rand(T, d)], rand(T, d), rand(T, d)
    query = torch.randn(d, generator=g).to(common.compute_dtype(dtype)) * 0.05
    w = 1 + 0.1 * rand(d)
    h, p = norm.attn_res_mix_norm(blocks + [partial], a, query, 1e-5, w, 1e-5)
    assert torch.equal(_bits(p), _bits(partial + a))
    expected = common.rms_norm(attn_res.mix(blocks + [partial + a], query, 1e-5), w, 1e-5).to(dtype)
    assert torch.equal(_bits(h), _bits(expected))
    rows = torch.tensor([4, 0, 2], dtype=torch.int32)
    final = norm.attn_res_final_norm(blocks + [partial], a, query, 1e-5, rows, w, 1e-5)
    mixed = attn_res.mix(blocks + [partial + a], query, 1e-5).to(dtype)
    assert torch.equal(_bits(final), _bits(common.rms_norm(mixed[rows.long()], w, 1e-5)))
    gate = rand(T, 2, d // 2)
    x = rand(T, 2, d // 2)
    assert torch.equal(_bits(norm.gated_rms_norm(x, w[: d // 2], gate, 1e-5)),
                       _bits(common.gated_rms_norm(x, w[: d // 2], gate, 1e-5)))
    assert torch.equal(_bits(norm.glu(a, partial, 1, 4.0, 25.0)), _bits(common.glu(a, partial, 1, 4.0, 25.0)))
    gated = (x.float() * torch.sigmoid(gate.float())).to(dtype)
    assert torch.equal(_bits(norm.sigmoid_gate(x, gate)), _bits(gated))
