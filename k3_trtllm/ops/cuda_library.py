"""Thin torch bindings over the framework-free CUDA kernels in ``plugins/``.

The kernels are compiled (``build_scripts/build_kernels.sh``) into
``libk3_kernels.so`` with a C ABI; this package loads it with ctypes and installs
each kernel as the CUDA implementation of its ``k3::`` op. Nothing here is needed
on CPU-only machines: the fp32 reference implementations stay in effect.
"""
from __future__ import annotations

import contextlib
import ctypes
import os
import threading
import warnings
from pathlib import Path

import torch

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


def stream_of(t: torch.Tensor) -> int:
    """The current CUDA stream of ``t``'s device as a raw pointer, for a launcher's stream argument:
    torch's own getter for kernel launchers (what inductor's launches use), a fraction of the cost
    of ``torch.cuda.current_stream(device).cuda_stream``, which builds a Stream object."""
    return torch._C._cuda_getCurrentRawStream(t.get_device())


_ALREADY_CURRENT = contextlib.nullcontext()


def on_device_of(t: torch.Tensor):
    """``torch.cuda.device(t.device)`` for a launcher that works on the current device, or a no-op
    context when that device is current already (the common case: entering and leaving the
    device context costs microseconds on every launch)."""
    index = t.get_device()
    return _ALREADY_CURRENT if index == torch.cuda.current_device() else torch.cuda.device(index)


def check(status: int, what: str) -> None:
    """Launchers return a cudaError_t; 0 is success."""
    if status != 0:
        raise RuntimeError(f"{what} failed with CUDA error {status}")


def unsupported_tensors(tensors: dict[str, torch.Tensor], dtype_of: dict[str, torch.dtype]) -> str | None:
    """Why the kernels cannot read these tensors, or None: they take the dtypes ``dtype_of`` gives
    (names it leaves out: any dtype), contiguous and 16-byte aligned (vector and cp.async loads)."""
    for name, t in tensors.items():
        if name in dtype_of and t.dtype != dtype_of[name]:
            return f"{name} of dtype {str(t.dtype).removeprefix('torch.')} (they take " \
                   f"{str(dtype_of[name]).removeprefix('torch.')})"
        if not t.is_contiguous():
            return f"a non-contiguous {name}"
        if t.data_ptr() % 16:
            return f"{name} not 16-byte aligned"
    return None


class KernelFallbackWarning(RuntimeWarning):
    """A k3 op on CUDA ran its reference implementation because the kernels do not cover the call."""


# (op, reason) pairs already warned about: a model calls each op every step, and one
# warning per distinct cause says all there is to say.
_warned: set[tuple[str, str]] = set()
_warned_lock = threading.Lock()  # the serve engine loop and a caller's thread may both run ops


def fall_back(op: str, reason: str, reference, *args):
    """Run ``reference(*args)`` in place of the CUDA kernel of ``op``, warning (once per
    distinct ``reason``) that the kernels do not support the call: a model whose dims the
    kernels were not built for still runs, slowly, instead of failing mid-run."""
    with _warned_lock:
        first = (op, reason) not in _warned
        _warned.add((op, reason))
    if first:
        warnings.warn(f"k3::{op}: the CUDA kernels do not support {reason}; running the reference op "
                      "(fp32 torch code, slow) for such calls", KernelFallbackWarning, stacklevel=3)
    return reference(*args)


def register_cuda_kernels() -> bool:
    """Install every kernel family as the CUDA implementation of its ``k3::`` ops.
    Returns False, leaving the reference ops in charge, when the library is not built."""
    if not library_path().exists():
        return False
    from .kda import cuda as _kda  # noqa: F401  (each registers its ops on import)
    from .mla import cuda as _mla  # noqa: F401
    from .moe import cuda as _moe  # noqa: F401
    return True
