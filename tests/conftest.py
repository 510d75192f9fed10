"""Shared fixtures: synthetic checkpoints are written once per session (they are cheap but
every model test needs one); every test runs torch single-threaded."""
from __future__ import annotations

import faulthandler
import sys

import pytest
import torch

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


@pytest.fixture(scope="session", autouse=True)
def one_thread():
    # Tiny tensors: intra-op threads only spin against each other on a shared 2-core
    # CI machine (measured 10x slower), so the whole suite runs single-threaded.
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


# No test takes minutes on the 2-core CI machine; one that hangs (a lost rank, a stuck server)
# must fail the run with every thread's stack instead of holding CI until its hard limit.
TEST_HANG_S = 600


@pytest.fixture(autouse=True)
def hang_watchdog():
    faulthandler.dump_traceback_later(TEST_HANG_S, exit=True, file=sys.stderr)
    yield
    faulthandler.cancel_dump_traceback_later()
