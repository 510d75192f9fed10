"""Import TensorRT's Python bindings: ``tensorrt`` if installed, else TensorRT-RTX's
``tensorrt_rtx_bindings`` (DESIGN §6), after the packaging fix the RTX wheels need."""
from __future__ import annotations

import importlib
import importlib.util
import os
from pathlib import Path
from types import ModuleType

INSTALL_HINT = (
    "no TensorRT Python bindings found: install TensorRT-RTX with "
    "`pip install tensorrt-rtx-cu13-bindings==1.7.1.116 tensorrt-rtx-cu13-libs==1.7.1.116` "
    "(its builder runs without a GPU), or TensorRT with `pip install tensorrt` on a machine with an NVIDIA driver"
)
MODULES = {"tensorrt": "tensorrt", "tensorrt-rtx": "tensorrt_rtx_bindings"}


class BuilderUnavailable(RuntimeError):
    pass


def fix_rtx_parser_library() -> Path | None:
    """The RTX ONNX parser dlopens ``libtensorrt_rtx.so`` but the libs wheel ships only
    ``libtensorrt_rtx.so.1``; without the unversioned name the process aborts with
    ``terminate called without an active exception`` at parse time. Adds the symlink
    beside the library (atomically); returns it, or None when the wheel is absent."""
    spec = importlib.util.find_spec("tensorrt_rtx_libs")
    if spec is None or not spec.submodule_search_locations:
        return None
    libdir = Path(list(spec.submodule_search_locations)[0])
    link, target = libdir / "libtensorrt_rtx.so", libdir / "libtensorrt_rtx.so.1"
    if link.exists() or not target.exists():
        return link if link.exists() else None
    tmp = libdir / f".libtensorrt_rtx.so.{os.getpid()}"
    try:
        tmp.unlink(missing_ok=True)
        tmp.symlink_to(target.name)
        os.replace(tmp, link)
    except OSError as e:
        raise BuilderUnavailable(
            f"cannot create {link} -> {target.name} ({e}); create it by hand or put a directory holding "
            "that symlink on LD_LIBRARY_PATH before starting Python") from e
    return link


def import_tensorrt(which: str = "auto") -> ModuleType:
    """``which``: "auto" (tensorrt, else TensorRT-RTX), "tensorrt" or "tensorrt-rtx"."""
    names = list(MODULES) if which == "auto" else [which]
    if which not in ("auto", *MODULES):
        raise ValueError(f"builder must be auto, tensorrt or tensorrt-rtx, got {which!r}")
    for name in names:
        if importlib.util.find_spec(MODULES[name]) is None:
            continue
        if name == "tensorrt-rtx":
            fix_rtx_parser_library()
        try:
            return importlib.import_module(MODULES[name])
        except ImportError as e:  # e.g. the PyPI `tensorrt` stub on a machine without its libraries
            if which != "auto":
                raise BuilderUnavailable(f"importing {MODULES[name]} failed: {e}. {INSTALL_HINT}") from e
    raise BuilderUnavailable(INSTALL_HINT if which == "auto" else f"{MODULES[which]} is not installed. {INSTALL_HINT}")
