"""Shared fixtures: synthetic checkpoints are written once per session (they are cheap but
every model test needs one)."""
from __future__ import annotations

import pytest

from k3_trtllm.checkpoint.synth import synth_checkpoint


@pytest.fixture(scope="session")
def ckpt_dir(tmp_path_factory):
    """``ckpt_dir(preset, seed=0)`` -> path of a synthesised HF checkpoint."""
    made = {}

    def make(preset: str = "tiny", seed: int = 0):
        key = (preset, seed)
        if key not in made:
            made[key] = synth_checkpoint(tmp_path_factory.mktemp(preset) / "ckpt", preset, seed)
        return made[key]

    return make
