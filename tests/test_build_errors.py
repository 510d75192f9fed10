"""`k3-trt build` that cannot do what was asked says why, in one line, before the slow part
(issue 15 items 7 and 8): an explicit builder that cannot write a plan (bindings, plugin
library, plugin creators), the `onnx` extra missing, a full disk during the export.

The plugin registry is process-wide and other tests register Python creators in it, so
the checks that depend on an empty registry run `k3-trt build` in a fresh interpreter."""
from __future__ import annotations

import errno
import importlib.util
import os
import subprocess
import sys
import types
from pathlib import Path

import numpy
import pytest
from click.testing import CliRunner

import k3_trtllm.trt.engine_dir as engine_dir
from k3_trtllm.cli import main
from k3_trtllm.trt.bindings import BuilderUnavailable
from k3_trtllm.trt.builder import PlanBuildError, open_builder

TESTS = Path(__file__).resolve().parent
HAVE_RTX = importlib.util.find_spec("tensorrt_rtx_bindings") is not None
NEEDS_RTX = pytest.mark.skipif(not HAVE_RTX, reason="TensorRT-RTX not installed")
# printed by build before the model load and the export: a refusal must come before them
SLOW_STEPS = ("build: loading", "export:")


def _build_in_fresh_python(*args, prelude: str = ""):
    """`k3-trt build ARGS` in a new interpreter after ``prelude``; (rc, stdout + stderr)."""
    code = f"{prelude}\nfrom k3_trtllm.cli import main\nmain({[str(a) for a in ['build', *args]]!r})"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(TESTS), os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300)
    return proc.returncode, proc.stdout + proc.stderr


def _assert_refused_early(code: int, output: str, message: str, out: Path) -> None:
    """Exit 1 with one error line starting with ``message``, before the load and the export,
    and no output or temp dir."""
    assert code == 1, output
    assert "Traceback" not in output, output
    errors = [line for line in output.splitlines() if "error" in line]
    assert len(errors) == 1 and errors[0].startswith(f"k3-trt build: error: {message}"), output
    assert not any(step in output for step in SLOW_STEPS), output
    assert not out.exists() and not list(out.parent.glob(f".{out.name}.*"))


@pytest.mark.parametrize("module", ["onnx", "onnxscript"])
def test_missing_onnx_extra_names_the_extra(module, ckpt_dir, tmp_path):
    out = tmp_path / "out"
    code, output = _build_in_fresh_python(ckpt_dir("tiny"), out, "--builder", "none",
                                          prelude=f"import sys; sys.modules[{module!r}] = None  # not installed")
    _assert_refused_early(code, output, f"the ONNX export needs {module}, which is not installed: "
                                        "pip install 'k3-trt[onnx]'", out)


@NEEDS_RTX
def test_explicit_builder_without_plugin_creators_fails_before_the_export(ckpt_dir, tmp_path):
    """Today's behaviour was exit 0 with no plan, after the whole export."""
    out = tmp_path / "out"
    code, output = _build_in_fresh_python(ckpt_dir("tiny"), out, "--builder", "tensorrt-rtx")
    _assert_refused_early(code, output, "tensorrt_rtx_bindings has no plugin creator for K3KdaPrefill, K3MlaPrefill, "
                          "K3SituMoe (namespace 'k3', version '1'): pass --plugin-lib with the K3 plugin library "
                          "(build_scripts/build_plugins.sh builds it)", out)


@NEEDS_RTX
def test_creators_are_those_of_the_graphs_plugins(ckpt_dir, tmp_path):
    """Creators for every other contract registered: exactly the MoE one is named missing; the
    MXFP4 checkpoint's graph holds the MXFP4 MoE instead, which is registered."""
    prelude = f"""
from trt_creators import _REGISTERED, make_plugin_classes
from k3_trtllm.config import load_config
from k3_trtllm.export.exporter import graph_plugins
from k3_trtllm.ops.contract import ALL_CONTRACTS
from k3_trtllm.trt.bindings import import_tensorrt
from k3_trtllm.trt.builder import missing_creators
trt = import_tensorrt("tensorrt-rtx")
for contract in ALL_CONTRACTS:
    if contract.plugin != "K3SituMoe":
        _REGISTERED.append(make_plugin_classes(trt, contract)[1]())
        trt.get_plugin_registry().register_creator(_REGISTERED[-1], "k3")
print("mxfp4 plugins missing:", missing_creators(trt, graph_plugins(load_config({str(ckpt_dir("tiny-mxfp4"))!r}))))
"""
    out = tmp_path / "out"
    code, output = _build_in_fresh_python(ckpt_dir("tiny"), out, "--builder", "tensorrt-rtx", prelude=prelude)
    assert "mxfp4 plugins missing: []" in output, output
    _assert_refused_early(code, output, "tensorrt_rtx_bindings has no plugin creator for K3SituMoe (namespace 'k3', "
                                        "version '1'): pass --plugin-lib", out)


@NEEDS_RTX
@pytest.mark.parametrize("library, reason", [
    ("garbage", "invalid ELF header"),
    ("numpy", "it exports no getCreators: not a TensorRT plugin library"),
])
def test_plugin_library_that_does_not_load_says_why(library, reason, ckpt_dir, tmp_path):
    if library == "garbage":
        path = tmp_path / "libk3_trt_plugins.so"
        path.write_text("not a shared object\n" * 100)
    else:  # a real shared object that is no TensorRT plugin library
        path = Path(numpy.core._multiarray_umath.__file__)
    out = tmp_path / "out"
    result = CliRunner().invoke(main, ["build", str(ckpt_dir("tiny")), str(out), "--builder", "tensorrt-rtx",
                                       "--plugin-lib", str(path)])
    _assert_refused_early(result.exit_code, result.output,
                          f"tensorrt_rtx_bindings cannot load the plugin library {path}: ", out)
    assert reason in result.output, result.output


@NEEDS_RTX
def test_auto_builder_skips_the_plan_with_the_reason_and_explicit_raises():
    logged = []
    assert open_builder("auto", None, ["K3NoSuchPlugin"], logged.append) is None
    assert logged == ["build: no plan (tensorrt_rtx_bindings has no plugin creator for K3NoSuchPlugin (namespace "
                      "'k3', version '1'): pass --plugin-lib with the K3 plugin library "
                      "(build_scripts/build_plugins.sh builds it))"]
    with pytest.raises(PlanBuildError, match="no plugin creator for K3NoSuchPlugin"):
        open_builder("tensorrt-rtx", None, ["K3NoSuchPlugin"], logged.append)


def test_bindings_that_cannot_create_a_builder_say_why(monkeypatch):
    """TensorRT proper imports on a machine without a GPU, then fails to create a builder."""
    class Logger:
        ERROR = 0

        def __init__(self, severity):
            pass

    def no_gpu(logger):
        raise RuntimeError("CUDA initialization failure with error: 35")

    fake = types.ModuleType("tensorrt")
    fake.__version__, fake.Logger, fake.Builder = "10.0", Logger, no_gpu
    monkeypatch.setattr("k3_trtllm.trt.bindings.import_tensorrt", lambda which: fake)
    logged = []
    assert open_builder("auto", None, [], logged.append) is None
    assert logged == ["build: no plan (tensorrt 10.0 cannot create a builder here: CUDA initialization failure "
                      "with error: 35)"]
    with pytest.raises(BuilderUnavailable, match="cannot create a builder here: CUDA initialization failure"):
        open_builder("tensorrt", None, [], logged.append)


def test_disk_full_during_the_export(ckpt_dir, tmp_path, monkeypatch):
    """The ONNX save fails as a full disk makes it fail (onnx_ir writes through a Python file
    object: the OSError names no file): one line naming the output, no temp dir left."""
    def export(model, path, block_size, log, kv_cache_dtype):
        Path(path).write_bytes(b"part of a graph")
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(engine_dir, "export_step_onnx", export)
    out = tmp_path / "out"
    result = CliRunner().invoke(main, ["build", str(ckpt_dir("tiny")), str(out), "--builder", "none"])
    assert result.exit_code == 1 and "Traceback" not in result.output
    errors = [line for line in result.output.splitlines() if "error" in line]
    assert errors == [f"k3-trt build: error: {out}: cannot write it: {os.strerror(errno.ENOSPC)}; nothing was written"]
    assert list(tmp_path.iterdir()) == []
