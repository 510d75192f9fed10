"""Every ``--json`` output is strict JSON (RFC 8259: no Infinity / NaN), and the long
commands show progress on stderr (never on stdout, which carries the result), silent
under ``--quiet``."""
from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner

from k3_trtllm.cli import main
from k3_trtllm.utils import strict_json

ROOT = Path(__file__).resolve().parents[1]
POOL = ["--dtype", "float32", "--device", "cpu", "--num-blocks", "64", "--max-slots", "4", "--block-size", "8"]


def strict_loads(text: str):
    """json.loads that refuses the non-standard constants Python's json writes by default."""
    def refuse(name):
        raise ValueError(f"not JSON: {name}")
    return json.loads(text, parse_constant=refuse)


def invoke(*args):
    return CliRunner().invoke(main, [str(a) for a in args], catch_exceptions=False)


@pytest.fixture(scope="module")
def ckpt(ckpt_dir):
    return str(ckpt_dir("tiny"))


def test_strict_dumps_turns_non_finite_floats_into_null():
    value = {"a": math.inf, "b": [-math.inf, 1.5, (math.nan, 2)], "c": {"d": float("nan")}, "e": "inf", "f": 3}
    text = strict_json.dumps(value)
    assert strict_loads(text) == {"a": None, "b": [None, 1.5, [None, 2]], "c": {"d": None}, "e": "inf", "f": 3}
    with pytest.raises(ValueError):
        strict_loads(json.dumps(value))  # what the default encoder writes


def test_bench_default_arrival_rate_is_null_and_progress_is_on_stderr(ckpt):
    args = ["bench", ckpt, "--num-requests", 3, "--prompt-len", "2:5", "--output-len", "2", "--warmup", 0, *POOL]
    res = invoke(*args)  # --arrival-rate defaults to inf: all requests at once
    assert res.exit_code == 0, res.output
    report = strict_loads(res.stdout)
    assert report["config"]["arrival_rate"] is None and report["requests"] == 3
    assert "bench: 100%" in res.stderr and "3/3" in res.stderr
    quiet = invoke(*args, "--quiet")
    assert quiet.exit_code == 0 and strict_loads(quiet.stdout)["requests"] == 3
    assert quiet.stderr == ""


def test_run_json_is_strict_with_progress_over_the_prompts(ckpt):
    args = ["run", ckpt, "--prompt", "a", "--prompt", "b", "--prompt-ids", "5,6", "--max-new-tokens", 2, "--json",
            *POOL]
    res = invoke(*args)
    assert res.exit_code == 0, res.output
    assert len(strict_loads(res.stdout)["outputs"]) == 3
    assert "run: 100%" in res.stderr and "3/3" in res.stderr
    quiet = invoke(*args, "--quiet")
    assert quiet.exit_code == 0 and len(strict_loads(quiet.stdout)["outputs"]) == 3
    assert "run:" not in quiet.stderr
    # Streamed text is its own progress: no bar mixed into it.
    streamed = invoke("run", ckpt, "--prompt", "a", "--max-new-tokens", 2, *POOL)
    assert streamed.exit_code == 0 and "run:" not in streamed.stderr


def test_build_quiet_silences_the_stage_messages(ckpt, tmp_path, monkeypatch):
    """The build CLI hands its progress log to the build; --quiet hands a silent one."""
    from k3_trtllm.trt import engine_dir

    def fake_build(checkpoint, out_dir, limits, *, log, **kwargs):
        log("build: loading x")
        log("export: tracing 10 layers")
    monkeypatch.setattr(engine_dir, "build_engine_dir", fake_build)
    loud = invoke("build", ckpt, tmp_path / "out", "--builder", "none")
    assert loud.exit_code == 0, loud.output
    assert "build: loading x" in loud.stderr and "export: tracing 10 layers" in loud.stderr and loud.stdout == ""
    quiet = invoke("build", ckpt, tmp_path / "out", "--builder", "none", "--quiet")
    assert quiet.exit_code == 0 and quiet.output == ""


def test_build_shows_stages_without_known_third_party_noise(tmp_path):
    """A real build in a fresh process (torch's log handlers write to the real stderr):
    the stage messages show, torch.onnx's torchvision notices, torch's LeafSpec
    FutureWarning and the exporter's axis-name notices do not."""
    out = subprocess.run([sys.executable, "-c", "from k3_trtllm.cli import main; main()", "build", str(ROOT / "examples" / "tiny-k3"),
                          str(tmp_path / "engine"), "--builder", "none", "--dtype", "float32"],
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    assert "build: loading" in out.stderr and "export: wrote rank0.onnx" in out.stderr, out.stderr
    for noise in ("torchvision is not installed", "LeafSpec", "FutureWarning", "will not be used, since it shares"):
        assert noise not in out.stderr, out.stderr
    assert out.stdout == ""
