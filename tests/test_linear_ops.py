"""The dense projections (k3_trtllm/ops/linear): the ctypes params struct lays its fields out where
a C compiler lays out k3/linear_api.h's, the kernel's token limit is the header's, and off CUDA the
op is torch's linear, bitwise (the skinny kernel is CUDA-only: tests/gpu/test_linear_cuda.py)."""
from __future__ import annotations

import ctypes
import shutil
import subprocess
from pathlib import Path

import pytest
import torch
from torch.nn import functional as F

from k3_trtllm.ops.linear import cuda, linear, linear_fp32

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("compiler,suffix", [("gcc", "c"), ("g++", "cpp")])
def test_ctypes_struct_matches_the_c_header(compiler, suffix, tmp_path):
    if shutil.which(compiler) is None:
        pytest.skip(f"{compiler} not installed")
    name, struct = "K3SkinnyLinearParams", cuda.SkinnyLinearParams
    lines = ["#include <stdio.h>", "#include <stddef.h>", "#include \"k3/linear_api.h\"", "int main(void) {",
             f'  printf("sizeof %zu\\n", sizeof({name}));', '  printf("max %d\\n", K3_SKINNY_MAX_TOKENS);']
    expected = [f"sizeof {ctypes.sizeof(struct)}", f"max {cuda.MAX_TOKENS}"]
    for field, _ in struct._fields_:
        lines.append(f'  printf("{field} %zu\\n", offsetof({name}, {field}));')
        expected.append(f"{field} {getattr(struct, field).offset}")
    lines += ["  return 0;", "}"]
    src, exe = tmp_path / f"linear_abi.{suffix}", tmp_path / "linear_abi"
    src.write_text("\n".join(lines) + "\n")
    # the header includes cuda_runtime.h only for cudaStream_t: a stand-in keeps the check toolkit-free
    (tmp_path / "cuda_runtime.h").write_text("typedef struct CUstream_st* cudaStream_t;\n")
    subprocess.run([compiler, "-I", str(tmp_path), "-I", str(ROOT / "plugins/include"), str(src), "-o", str(exe)],
                   check=True)
    assert subprocess.run([str(exe)], check=True, capture_output=True, text=True).stdout.splitlines() == expected


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.float64])
@pytest.mark.parametrize("tokens", [1, 4, 9])
def test_off_cuda_it_is_torchs_linear_bitwise(dtype, tokens):
    g = torch.Generator().manual_seed(tokens)
    x, w = torch.randn(tokens, 64, generator=g).to(dtype), torch.randn(24, 64, generator=g).to(dtype)
    assert torch.equal(linear(x, w), F.linear(x, w))
    assert linear_fp32(x, w) is None  # the LM head then takes its own fp32 path
