"""Which implementation a GPU model gets: the CUDA kernels when their library is built,
otherwise the reference ops with a warning (the kernels themselves are tested on the H200
in tests/gpu/)."""
from __future__ import annotations

import pytest

from k3_trtllm.ops import cuda_library as kernels


def test_missing_library_leaves_the_reference_ops(monkeypatch, tmp_path):
    monkeypatch.setenv("K3_KERNELS_LIB", str(tmp_path / "absent.so"))
    assert kernels.library_path() == tmp_path / "absent.so"
    assert kernels.register_cuda_kernels() is False
    with pytest.raises(FileNotFoundError, match="absent.so not found: run build_scripts/build_kernels.sh"):
        kernels.load_library()
