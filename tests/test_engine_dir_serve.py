"""`serve` of a segmented engine dir (issue 17): behind a real tritonserver the Triton model runs
the engine's segments on EngineExecutor (CPU backend), and concurrent streams equal `k3-trt run`
of the checkpoint (test_triton_server's ``reference`` fixture: same prompts, greedy). The
repository carries only the settings the user gave, so the engine's own dtype and limits apply;
options an engine dir cannot take are refused in one line."""
from __future__ import annotations

import re

import pytest
from click.testing import CliRunner
from test_triton_server import (  # noqa: F401  (the fixture and the test run here, on an engine dir)
    TINY, reference, running_server,
    test_concurrent_streams_equal_k3_trt_run_greedy_output)

from k3_trtllm.cli import main
from k3_trtllm.convert import convert_checkpoint

# the limits of test_triton_server.ENGINE, which the reference run used
BUILD = ["--layout", "segments", "--builder", "none", "--quiet", "--dtype", "float32", "--max-batch-size", "8",
         "--max-seq-len", "96", "--block-size", "16", "--max-num-tokens", "256"]


@pytest.fixture(scope="module")
def engine_dir(tmp_path_factory):
    root = tmp_path_factory.mktemp("engine-serve")
    convert_checkpoint(TINY, root / "ckpt", progress=False)
    result = CliRunner().invoke(main, ["build", str(root / "ckpt"), str(root / "engine"), *BUILD])
    assert result.exit_code == 0, result.output
    return root / "engine"


@pytest.fixture(scope="module")
def server(engine_dir, tmp_path_factory):
    work = tmp_path_factory.mktemp("triton-engine-dir")
    result = CliRunner().invoke(main, ["triton-repo", str(engine_dir), str(work / "repo"), "--num-blocks", "48",
                                       "--max-slots", "8", "--cancellation-check-period-ms", "10"])
    assert result.exit_code == 0, result.output
    pbtxt = (work / "repo" / "k3" / "config.pbtxt").read_text()
    given = dict(re.findall(r'key: "(\w+)" value: \{ string_value: "([^"]*)" \}', pbtxt))
    # what the user gave, plus the engine's batch bound and the prefix cache (on by default: the engine's KDA
    # plugins write the snapshots); not the CLI's other defaults (bfloat16, block 16)
    assert set(given) == {"model_dir", "max_batch_size", "num_blocks", "max_slots", "cancellation_check_period_ms",
                          "prefix_cache"}
    assert given["prefix_cache"] == "True"
    assert given["max_batch_size"] == "8" and "max_batch_size: 8" in pbtxt
    with running_server(work / "repo", work) as srv:
        yield srv


@pytest.mark.parametrize("option, message", [
    (["--tp", "2"], "--tp/--ep: engine dir"),
    (["--batch-invariant"], "--batch-invariant: not available for engine dirs"),
    (["--dtype", "bfloat16", "--num-blocks", "4"], None),  # written as given; the engine checks it at load
])
def test_triton_repo_of_an_engine_dir_takes_only_what_it_can(engine_dir, tmp_path, option, message):
    result = CliRunner().invoke(main, ["triton-repo", str(engine_dir), str(tmp_path / "repo"), *option])
    if message is None:
        assert result.exit_code == 0, result.output
        assert 'key: "dtype" value: { string_value: "bfloat16" }' in (tmp_path / "repo/k3/config.pbtxt").read_text()
    else:
        assert result.exit_code == 1 and message in result.output and "Traceback" not in result.output
        assert not (tmp_path / "repo").exists()
