"""The launchers' C ABI: params structs generated from the contracts (k3_trtllm/ops/c_abi.py).

The committed header and plugin code equal the generators' output, the ctypes twins lay the
fields out where a C compiler does, a filled struct carries each contract dim's value, and
every contract launcher takes its struct (no positional argument lists left)."""
from __future__ import annotations

import ctypes
import re
import shutil
import subprocess
from pathlib import Path

import pytest
import torch

from k3_trtllm.export.cpp_contracts import generate_launch_params
from k3_trtllm.ops import c_abi
from k3_trtllm.ops.c_abi import DIM_FIELDS, PARAMS, generate
from k3_trtllm.ops.contract import ALL_CONTRACTS

ROOT = Path(__file__).resolve().parents[1]
HEADER = ROOT / "plugins/include/k3/params.h"


def test_committed_params_header_matches_the_contracts():
    assert HEADER.read_text() == generate(), \
        "regenerate: python -m k3_trtllm.ops.c_abi > plugins/include/k3/params.h"
    assert "do not edit" in HEADER.read_text().splitlines()[0]


def test_committed_plugin_launch_params_match_the_contracts():
    committed = (ROOT / "plugins/trt/launch_params.inc").read_text()
    assert committed == generate_launch_params(), ("regenerate: python -m k3_trtllm.export.cpp_contracts "
                                                   "launch_params.inc > plugins/trt/launch_params.inc")


def test_every_contract_has_one_params_struct():
    owners = [c for spec in PARAMS for c in spec.contracts]
    assert sorted(c.plugin for c in owners) == sorted(c.plugin for c in ALL_CONTRACTS)


def _offsets_program() -> str:
    lines = ["#include <stdio.h>", "#include <stddef.h>", '#include "k3/params.h"', "int main(void) {"]
    for spec in PARAMS:
        lines.append(f'  printf("{spec.name} sizeof %zu\\n", sizeof({spec.name}));')
        for f in spec.fields():
            lines.append(f'  printf("{spec.name} {f.name} %zu\\n", offsetof({spec.name}, {f.name}));')
    return "\n".join(lines + ["  return 0;", "}"]) + "\n"


@pytest.mark.parametrize("compiler,suffix", [("gcc", "c"), ("g++", "cpp")])
def test_ctypes_offsets_equal_the_c_compilers(compiler, suffix, tmp_path):
    if shutil.which(compiler) is None:
        pytest.skip(f"{compiler} not installed")
    src, exe = tmp_path / f"offsets.{suffix}", tmp_path / "offsets"
    src.write_text(_offsets_program())
    subprocess.run([compiler, "-I", str(ROOT / "plugins/include"), str(src), "-o", str(exe)], check=True)
    printed = subprocess.run([str(exe)], check=True, capture_output=True, text=True).stdout.splitlines()
    expected = []
    for spec in PARAMS:
        struct = spec.structure
        expected.append(f"{spec.name} sizeof {ctypes.sizeof(struct)}")
        expected += [f"{spec.name} {f.name} {getattr(struct, f.name).offset}" for f in spec.fields()]
    assert printed == expected


# One value per contract symbol; every shape expression evaluates to a positive size with them.
SYMBOLS = dict(T=5, P=8, H=2, W=4, B=3, S=4, K=4, V=4, Dn=6, Dr=2, R=8, Dv=4, max_blocks=3, num_blocks=7,
               block_size=2, D=6, L=64, E=8, El=3, I=96, N=2, Ns=5, Q=4)


def _extent(expr: str) -> int:
    return eval(expr.replace("/", "//"), {}, dict(SYMBOLS))  # noqa: S307  (contract expressions only)


@pytest.mark.parametrize("spec", PARAMS, ids=lambda s: s.name)
def test_fill_reads_every_dim_attribute_and_tensor(spec):
    c = spec.contract
    inputs = [torch.empty(tuple(_extent(e) for e in t.shape), dtype=torch.uint8) for t in c.inputs]
    outputs = [torch.empty(tuple(_extent(e) for e in t.shape), dtype=torch.uint8) for t in c.outputs]
    attrs = [0.25 * (i + 1) if a.kind == "float" else i + 11 for i, a in enumerate(c.attrs)]
    work = torch.empty(16, dtype=torch.uint8)
    p = spec.fill(inputs, outputs, attrs, work, 16)
    for t, spec_t in zip(inputs + outputs, c.inputs + c.outputs):
        assert getattr(p, spec_t.name) == t.data_ptr(), spec_t.name
    for symbol in spec.dims:
        assert getattr(p, DIM_FIELDS[symbol]) == SYMBOLS[symbol], symbol
    for a, v in zip(c.attrs, attrs):
        assert getattr(p, a.name) == pytest.approx(v), a.name
    assert p.workspace == work.data_ptr()
    if spec.workspace_bytes:
        assert p.workspace_bytes == 16
    for extra in spec.extras:
        assert getattr(p, extra.name) == 0


def test_fill_sets_the_extras_and_refuses_unknown_fields():
    c = c_abi.MLA.contract
    inputs = [torch.empty(tuple(_extent(e) for e in t.shape), dtype=torch.uint8) for t in c.inputs]
    out = torch.empty(1, dtype=torch.uint8)
    attrs = [1] * 5 + [0.5]
    assert c_abi.MLA.fill(inputs, (out,), attrs, key_chunk=256).key_chunk == 256
    with pytest.raises(ValueError, match="K3MlaParams: no field chunk"):
        c_abi.MLA.fill(inputs, (out,), attrs, chunk=256)
    with pytest.raises(ValueError, match="K3MlaParams: 9 inputs, 1 outputs and 6 attributes expected"):
        c_abi.MLA.fill(inputs[:-1], (out,), attrs)


def test_dim_source_reads_back_scaled_and_offset_dims():
    src = c_abi.dim_source(c_abi.SITU_MOE_MXFP4_PARAMS.contract, "I")  # only in 2*I, I/2, I/32
    assert (src.input, src.dim, src.value(192)) == (4, 1, 96)
    assert c_abi.dim_source(c_abi.KDA.contract, "B").value(3) == 3  # state_slots [B] before cu_seqlens [B+1]
    with pytest.raises(ValueError, match="no input dim gives Q"):
        c_abi.dim_source(c_abi.KDA.contract, "Q")


def test_every_contract_launcher_takes_its_params_struct():
    declared = {}
    for header in sorted((ROOT / "plugins/include/k3").glob("*_api.h")):
        declared.update(re.findall(r"int (k3_\w+)\(const (K3\w+Params)\* \w+, cudaStream_t stream\);",
                                   header.read_text()))
    launchers = {"k3_kda_prefill": "K3KdaParams", "k3_kda_decode": "K3KdaParams", "k3_mla_prefill": "K3MlaParams",
                 "k3_mla_decode": "K3MlaParams", "k3_mla_prefill_expanded": "K3MlaParams",
                 "k3_mla_prefill_fp8": "K3MlaFp8Params", "k3_mla_decode_fp8": "K3MlaFp8Params",
                 "k3_mla_prefill_expanded_fp8": "K3MlaFp8Params",
                 "k3_situ_moe": "K3SituMoeParams", "k3_situ_moe_mxfp4": "K3SituMoeMxfp4Params"}
    assert {n: declared.get(n) for n in launchers} == launchers
    assert set(launchers.values()) == {s.name for s in PARAMS}
    for src in (ROOT / "plugins/trt").glob("*_plugins.cpp"):  # index lists come from launch_params.inc
        assert not re.search(r"\benum\s*\{", src.read_text()), src.name
