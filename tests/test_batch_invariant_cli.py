"""``--batch-invariant`` from the command line to the ranks (issue 23): the flag reaches every
engine the CLI and the Triton model build, survives config.pbtxt as a strict boolean, and is
refused where it cannot hold. Its GPU effect is proven on the H200 (tests/gpu/test_determinism.py);
on the CPU the reference ops are batch-invariant already, which the first test checks with
the flag on."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
from click.testing import CliRunner

from k3_trtllm.cli.run import run as run_command
from k3_trtllm.serve.repository import engine_kwargs_from_parameters, flag

TINY = Path(__file__).resolve().parents[1] / "examples" / "tiny-k3"
PROMPTS = ["5,6,7", "9,10,11,12,13", "3", "40,41,42,43"]
COMMON = ["--max-new-tokens", "6", "--temperature", "0", "--ignore-eos", "--device", "cpu", "--dtype", "float32",
          "--num-blocks", "64", "--max-slots", "4", "--json", "--quiet"]


def _tokens(args):
    result = CliRunner().invoke(run_command, [str(TINY), *args, *COMMON], catch_exceptions=False)
    assert result.exit_code == 0, result.output
    return [r["output_ids"] for r in json.loads(result.stdout)["outputs"]]


def test_batched_requests_equal_each_alone_under_the_flag():
    batched = _tokens(["--batch-invariant", *[a for p in PROMPTS for a in ("--prompt-ids", p)]])
    alone = [_tokens(["--batch-invariant", "--prompt-ids", p])[0] for p in PROMPTS]
    assert batched == alone
    assert batched == _tokens([a for p in PROMPTS for a in ("--prompt-ids", p)])  # CPU: the same ops


def test_the_flag_round_trips_through_config_pbtxt_strictly():
    for value in (True, False):
        _, engine, _ = engine_kwargs_from_parameters({"model_dir": "m", "batch_invariant": str(value)})
        assert engine["batch_invariant"] is value
    with pytest.raises(ValueError, match=r"batch_invariant='false' is not a flag"):
        engine_kwargs_from_parameters({"model_dir": "m", "batch_invariant": "false"})
    with pytest.raises(ValueError):
        flag("1")


def test_an_engine_dir_refuses_the_flag(monkeypatch):
    """Segmented engines run the ONNX segments, not the torch overrides the mode installs."""
    import k3_trtllm.trt.segment_layout as segment_layout

    monkeypatch.setattr(segment_layout, "is_segmented_engine_dir", lambda path: True)
    result = CliRunner().invoke(run_command, [str(TINY), "--batch-invariant", "--prompt-ids", "5", "--device", "cpu"])
    assert result.exit_code == 1
    assert "--batch-invariant: not available for engine dirs" in result.output
    assert "Traceback" not in result.output
