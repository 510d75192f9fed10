"""The C++ plugins follow the contracts, and the TensorRT glue fails clearly."""
from __future__ import annotations

import importlib.util
import os
import subprocess
from pathlib import Path

import pytest

from k3_trtllm.export.cpp_contracts import generate
from k3_trtllm.ops.contract import ALL_CONTRACTS
from k3_trtllm.trt.bindings import BuilderUnavailable, import_tensorrt

ROOT = Path(__file__).resolve().parents[1]


def test_committed_cpp_contract_tables_match_the_contracts():
    committed = (ROOT / "plugins/trt/contracts.inc").read_text()
    assert committed == generate(), "regenerate: python -m k3_trtllm.export.cpp_contracts > plugins/trt/contracts.inc"
    for c in ALL_CONTRACTS:
        assert f'"{c.plugin}"' in committed


def test_plugin_library_exports_a_creator_per_kernel_backed_op():
    entry = (ROOT / "plugins/trt/plugin_entry.cpp").read_text()
    for ident in ("kKdaPrefill", "kKdaDecode", "kMlaPrefill", "kMlaDecode", "kMlaPrefillFp8", "kMlaDecodeFp8",
                  "kSituMoe", "kSituMoeMxfp4"):
        assert f"({ident}, {ident}Kernels)" in entry


def test_build_script_requires_tensorrt_headers(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "TENSORRT_INCLUDE_DIR"}
    result = subprocess.run(["bash", str(ROOT / "build_scripts/build_plugins.sh"), str(tmp_path)],
                            env=env, capture_output=True, text=True)
    assert result.returncode == 2 and "TENSORRT_INCLUDE_DIR is not set" in result.stderr
    assert not any(tmp_path.iterdir())


def test_unknown_builder_name_is_rejected():
    with pytest.raises(ValueError, match="auto, tensorrt or tensorrt-rtx"):
        import_tensorrt("trt")


@pytest.mark.skipif(importlib.util.find_spec("tensorrt") is not None, reason="TensorRT proper is installed")
def test_missing_tensorrt_names_both_install_routes():
    with pytest.raises(BuilderUnavailable, match="tensorrt-rtx-cu13-bindings.*pip install tensorrt"):
        import_tensorrt("tensorrt")


@pytest.mark.skipif(importlib.util.find_spec("tensorrt_rtx_bindings") is None, reason="TensorRT-RTX not installed")
def test_rtx_import_adds_the_unversioned_parser_library_name():
    trt = import_tensorrt("tensorrt-rtx")
    libdir = Path(importlib.util.find_spec("tensorrt_rtx_libs").submodule_search_locations[0])
    link = libdir / "libtensorrt_rtx.so"
    assert link.is_symlink() and link.resolve() == (libdir / "libtensorrt_rtx.so.1").resolve()
    assert trt.__name__ == "tensorrt_rtx_bindings"
