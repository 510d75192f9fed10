"""`k3-trt triton-repo` and `k3-trt serve` end to end: the served tiny model streams to
examples/triton_client.py; SIGTERM with a live stream ends that stream at once with
"server shutting down", then stops everything (loopback only, bounded)."""
import json
import queue
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from click.testing import CliRunner
from helpers import free_port, live_processes

from k3_trtllm.cli import main

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


@pytest.mark.parametrize("command", ["triton-repo", "serve"])
def test_model_name_is_checked_before_anything_is_written(tmp_path, command):
    args = [command, str(TINY), *([str(tmp_path / "r")] if command == "triton-repo" else []),
            "--name", 'k3" } parameters { key: "x']
    result = CliRunner().invoke(main, args)
    assert result.exit_code == 2 and "Invalid value for '--name'" in result.output and "model name" in result.output
    assert list(tmp_path.iterdir()) == []


def open_stream(grpc_port, prompt, max_tokens):
    """A live gRPC stream of one request; its responses (result, error, arrival time) on a queue."""
    import tritonclient.grpc as grpcclient
    from tritonclient.utils import np_to_triton_dtype

    events = queue.Queue()
    client = grpcclient.InferenceServerClient(f"127.0.0.1:{grpc_port}")
    client.start_stream(callback=lambda result, error: events.put((result, error, time.monotonic())))
    inputs = []
    for name, array in (("text_input", np.array([[prompt.encode()]], dtype=np.object_)),
                        ("max_tokens", np.array([[max_tokens]], dtype=np.int32)), ("stream", np.array([[True]]))):
        t = grpcclient.InferInput(name, list(array.shape), np_to_triton_dtype(array.dtype))
        t.set_data_from_numpy(array)
        inputs.append(t)
    client.async_stream_infer("k3", inputs, request_id="live", enable_empty_final_response=True)
    return client, events


def test_serve_streams_to_the_example_client_and_drains_on_sigterm(tmp_path):
    repo = tmp_path / "repo"
    grpc_port = free_port()
    log = open(tmp_path / "stdout.log", "w")  # noqa: SIM115 — the server writes it until it stops
    engine_args = ["--dtype", "float32", "--max-batch-size", "4", "--max-seq-len", "1024", "--num-blocks", "80",
                   "--max-slots", "4"]
    serve = subprocess.Popen(
        [sys.executable, "-c", "from k3_trtllm.cli import main; main()", "serve", str(TINY), "--repo-dir", str(repo),
         "--http-port", str(free_port()), "--grpc-port", str(grpc_port), "--metrics-port", str(free_port()),
         "--startup-timeout", "120", *engine_args],
        stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.PIPE, text=True)
    client = None
    try:
        ready, ours = "", []
        for line in serve.stderr:  # serve's messages among the server's log lines
            if line.startswith("k3-trt:"):
                ours.append(line)
            if line.startswith("k3-trt: model"):
                ready = line
                break
        assert f"gRPC 127.0.0.1:{grpc_port}" in ready, f"serve did not get ready: {serve.poll()=}"
        # The tiny model has no tiktoken.model: serve says so, once, before it is ready.
        assert [line for line in ours if "byte tokenizer" in line] == [
            f"k3-trt: warning: {TINY} has no tiktoken.model: using the byte tokenizer (UTF-8 bytes as ids 3-258), "
            "whose text is not the K3 tokenizer's\n"]

        stubs = [p.split(":")[0] for p in live_processes((str(repo),)) if "triton_python_backend_stub" in p]
        # A stub's arguments: model.py, then the name of its shared-memory region.
        regions = [Path("/dev/shm") / Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")[2].decode()
                   for pid in stubs]
        assert regions and all(r.exists() for r in regions)

        result = subprocess.run([sys.executable, str(ROOT / "examples" / "triton_client.py"), "--url",
                                 f"127.0.0.1:{grpc_port}", "--prompt", "Hello", "--max-tokens", "5"],
                                capture_output=True, text=True, timeout=120)
        assert result.returncode == 0, result.stderr
        summary = result.stdout.strip().splitlines()[-1]
        assert summary.startswith("[5 tokens] ") and len(json.loads(summary.split("] ", 1)[1])) == 5

        # A live stream (1000 tokens: tens of seconds here), then SIGTERM.
        client, events = open_stream(grpc_port, "Hi", 1000)
        for _ in range(2):
            response, error, _ = events.get(timeout=60)
            assert error is None, error
        start = time.monotonic()
        serve.send_signal(signal.SIGTERM)
        while True:  # tokens already on their way, then the error that ends the stream
            response, error, arrived = events.get(timeout=30)
            if error is not None:
                break
        assert "server shutting down" in str(error)
        assert arrived - start < 2.0, f"the stream ended {arrived - start:.1f} s after SIGTERM"
        # The client keeps its stream open: tritonserver cannot unload the model, so serve kills it.
        _, stderr = serve.communicate(timeout=40)
        assert serve.returncode == 0, stderr[-2000:]
        assert time.monotonic() - start < 15
        assert "keeping a gRPC stream open holds the model); killed it" in stderr
        assert not [r for r in regions if r.exists()], "the killed stub's shared memory is left in /dev/shm"
    finally:
        if client is not None:
            client.stop_stream()
            client.close()
        if serve.poll() is None:
            serve.kill()  # the server then gets SIGINT from the kernel (it dies with its parent)
            serve.communicate()
        log.close()
    deadline = time.monotonic() + 20
    while live_processes((str(repo),)) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not live_processes((str(repo),))
