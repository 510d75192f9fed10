"""`k3-trt triton-repo` and `k3-trt serve` end to end: the served tiny model streams to
examples/triton_client.py, and SIGINT stops everything (loopback only, bounded)."""
import json
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

from click.testing import CliRunner
from helpers import live_processes

from k3_trtllm.cli import main
from k3_trtllm.utils.net import free_port

ROOT = Path(__file__).resolve().parents[1]
TINY = ROOT / "examples" / "tiny-k3"
ENGINE_ARGS = ["--dtype", "float32", "--max-batch-size", "4", "--max-seq-len", "64", "--num-blocks", "32",
               "--max-slots", "4"]


def test_triton_repo_writes_a_decoupled_python_model(tmp_path):
    result = CliRunner().invoke(main, ["triton-repo", str(TINY), str(tmp_path), "--name", "tiny", *ENGINE_ARGS])
    assert result.exit_code == 0, result.output
    config = (tmp_path / "tiny" / "config.pbtxt").read_text()
    assert 'backend: "python"' in config and "decoupled: true" in config and "max_batch_size: 4" in config
    parameters = dict(re.findall(r'key: "(\w+)" value: \{ string_value: "([^"]*)" \}', config))
    assert parameters["model_dir"] == str(TINY) and parameters["dtype"] == "float32"
    assert parameters["num_blocks"] == "32" and "device" not in parameters  # unset: the model picks cuda or cpu
    assert "k3_trtllm.serve.triton_model" in (tmp_path / "tiny" / "1" / "model.py").read_text()

    bad = CliRunner().invoke(main, ["triton-repo", str(tmp_path), str(tmp_path / "r")])
    assert bad.exit_code != 0 and "no config.json" in bad.output


def test_serve_streams_to_the_example_client_and_stops_on_sigint(tmp_path):
    repo = tmp_path / "repo"
    grpc_port = free_port()
    log = open(tmp_path / "stdout.log", "w")  # noqa: SIM115 — the server writes it until it stops
    serve = subprocess.Popen(
        [sys.executable, "-c", "from k3_trtllm.cli import main; main()", "serve", str(TINY), "--repo-dir", str(repo),
         "--http-port", str(free_port()), "--grpc-port", str(grpc_port), "--metrics-port", str(free_port()),
         "--startup-timeout", "120", *ENGINE_ARGS],
        stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.PIPE, text=True)
    try:
        ready = ""
        for line in serve.stderr:  # serve's messages among the server's log lines
            if line.startswith("k3-trt: model"):
                ready = line
                break
        assert f"gRPC 127.0.0.1:{grpc_port}" in ready, f"serve did not get ready: {serve.poll()=}"

        client = subprocess.run([sys.executable, str(ROOT / "examples" / "triton_client.py"), "--url",
                                 f"127.0.0.1:{grpc_port}", "--prompt", "Hello", "--max-tokens", "5"],
                                capture_output=True, text=True, timeout=120)
        assert client.returncode == 0, client.stderr
        summary = client.stdout.strip().splitlines()[-1]
        assert summary.startswith("[5 tokens] ") and len(json.loads(summary.split("] ", 1)[1])) == 5

        start = time.monotonic()
        serve.send_signal(signal.SIGINT)
        serve.communicate(timeout=40)
        assert serve.returncode == 0
        assert time.monotonic() - start < 40
    finally:
        if serve.poll() is None:
            serve.kill()  # the server then gets SIGINT from the kernel (it dies with its parent)
            serve.communicate()
        log.close()
    deadline = time.monotonic() + 20
    while live_processes((str(repo),)) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not live_processes((str(repo),))
