"""Thin torch bindings over the framework-free CUDA kernels in ``plugins/``.

The kernels are compiled (``build_scripts/build_kernels.sh``) into
``libk3_kernels.so`` with a C ABI; this package loads it with ctypes and installs
each kernel as the CUDA implementation of its ``k3::`` op. Nothing here is needed
on CPU-only machines: the fp32 reference implementations stay in effect.
"""
from __future__ import annotations

import ctypes
import os
from pathlib import Path

_REPO_BUILD = Path(__file__).resolve().parents[2] / "build" / "libk3_kernels.so"


def library_path() -> Path:
    env = os.environ.get("K3_KERNELS_LIB")
    return Path(env) if env else _REPO_BUILD


def load_library() -> ctypes.CDLL:
    path = library_path()
    if not path.exists():
        raise FileNotFoundError(
            f"CUDA kernel library {path} not found: run build_scripts/build_kernels.sh "
            "(or set K3_KERNELS_LIB)"
        )
    return ctypes.CDLL(str(path))


def check(status: int, what: str) -> None:
    """Launchers return a cudaError_t; 0 is success."""
    if status != 0:
        raise RuntimeError(f"{what} failed with CUDA error {status}")


def register_cuda_kernels() -> bool:
    """Install every kernel family as the CUDA implementation of its ``k3::`` ops.
    Returns False, leaving the reference ops in charge, when the library is not built."""
    if not library_path().exists():
        return False
    from . import kda, mla, moe  # noqa: F401  (each registers its ops on import)
    return True
