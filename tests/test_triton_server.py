"""A real tritonserver (from the nvidia-pytriton wheel) serving the tiny model over
loopback gRPC: concurrent streams equal `k3-trt run` greedy output, bad requests get
errors without breaking the server, cancellation frees the engine's blocks and slots,
and stopping the server is bounded and leaves no process behind.

The server starts once per module; if it cannot start, every test here fails (CI installs
what it needs: see k3_trtllm/serve/server.py INSTALL_HINT)."""
import contextlib
import json
import os
import queue
import re
import time
from pathlib import Path

import numpy as np
import pytest
import torch
import tritonclient.grpc as grpcclient
from click.testing import CliRunner
from helpers import free_port, live_processes
from tritonclient.utils import np_to_triton_dtype

from k3_trtllm.cli.run import run as run_command
from k3_trtllm.runtime.engine import build_engine
from k3_trtllm.runtime.tokenizer import ByteTokenizer
from k3_trtllm.serve.protocol import parse_request
from k3_trtllm.serve.repository import write_model_repository
from k3_trtllm.serve.server import TritonServer

TINY = Path(__file__).resolve().parents[1] / "examples" / "tiny-k3"
ENGINE = dict(dtype="float32", max_batch_size=8, max_seq_len=96, num_blocks=64, max_slots=8, block_size=16)
PROMPTS = ["a", "K3", "hello", "tensorrt", "inflight batching", "a somewhat longer prompt", "one two three four five",
           "the quick brown fox jumps over"]
MAX_TOKENS = [3, 5, 4, 6, 2, 5, 3, 4]
START_TIMEOUT_S = 120  # model load on a busy 2-core machine; usually ~10 s
RESPONSE_TIMEOUT_S = 60
STOP_TIMEOUT_S = 30  # SIGINT, then Triton's exit timeout (5 s here), then SIGKILL


def leftover_processes(server: TritonServer) -> list[str]:
    """Live processes of the server's group or naming its folders (server, backend stubs)."""
    return live_processes((str(server.repo_dir), str(server.work_dir)), server.process.pid)


@contextlib.contextmanager
def running_server(repo: Path, work: Path):
    """tritonserver on ``repo`` (loopback ports), ready; stopped on exit, leaving no process."""
    srv = TritonServer(repo, work, http_port=free_port(), grpc_port=free_port(), metrics_port=free_port(),
                       log_file=work / "server.log", exit_timeout_s=5)
    srv.start()
    try:
        srv.wait_ready(START_TIMEOUT_S)
        yield srv
    finally:
        srv.stop(STOP_TIMEOUT_S)
        assert not leftover_processes(srv), "processes left after stopping tritonserver"


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    work = tmp_path_factory.mktemp("triton")
    write_model_repository(TINY, work / "repo", name="k3", cancellation_check_period_ms=10, **ENGINE)
    with running_server(work / "repo", work) as srv:
        yield srv


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """`k3-trt run` greedy output (ids and text) for PROMPTS, with the server's engine settings."""
    prompts_file = tmp_path_factory.mktemp("ref") / "prompts.jsonl"
    prompts_file.write_text("".join(json.dumps({"prompt": p, "max_new_tokens": n}) + "\n"
                                    for p, n in zip(PROMPTS, MAX_TOKENS)))
    args = [str(TINY), "--prompts-file", str(prompts_file), "--temperature", "0", "--json", "--no-stream",
            "--device", "cpu"]
    for key, value in ENGINE.items():
        args += [f"--{key.replace('_', '-')}", str(value)]
    result = CliRunner().invoke(run_command, args, catch_exceptions=False)
    assert result.exit_code == 0, result.output
    return [(o["output_ids"], o["text"]) for o in json.loads(result.stdout)["outputs"]]


def tensor(name, array):
    t = grpcclient.InferInput(name, list(array.shape), np_to_triton_dtype(array.dtype))
    t.set_data_from_numpy(array)
    return t


def request(prompt=None, max_tokens=None, stream=True, **extra):
    """Inputs with the batch dimension of one request; ``max_tokens`` an int or a ready
    array, ``extra``: name -> numpy array."""
    tensors = {"stream": np.array([[stream]])}
    if prompt is not None:
        tensors["text_input"] = np.array([[prompt.encode()]], dtype=np.object_)
    if isinstance(max_tokens, np.ndarray):
        tensors["max_tokens"] = max_tokens
    elif max_tokens is not None:
        tensors["max_tokens"] = np.array([[max_tokens]], dtype=np.int32)
    tensors.update(extra)
    return [tensor(name, array) for name, array in tensors.items()]


class Stream:
    """One gRPC stream; responses of all its requests arrive on one queue."""

    def __init__(self, server: TritonServer) -> None:
        self.client = grpcclient.InferenceServerClient(server.grpc_url)
        self.events = queue.Queue()
        self.client.start_stream(callback=lambda result, error: self.events.put((result, error)))

    def send(self, inputs, request_id="r") -> None:
        self.client.async_stream_infer("k3", inputs, request_id=request_id, enable_empty_final_response=True)

    def next(self):
        """(request id, output ids, text, final) of the next response; raises on an error response."""
        result, error = self.events.get(timeout=RESPONSE_TIMEOUT_S)
        if error is not None:
            raise error
        response = result.get_response()
        final = response.parameters["triton_final_response"].bool_param
        if not response.outputs:
            return response.id, None, None, final
        text = result.as_numpy("text_output").reshape(-1)[0].decode()
        return response.id, result.as_numpy("output_ids").reshape(-1).tolist(), text, final

    def collect(self, request_ids) -> dict[str, list[tuple[list[int], str]]]:
        """Responses with outputs per request, until each request's final response."""
        chunks = {rid: [] for rid in request_ids}
        open_ids = set(request_ids)
        while open_ids:
            rid, ids, text, final = self.next()
            if ids is not None:
                chunks[rid].append((ids, text))
            if final:
                open_ids.remove(rid)
        return chunks

    def close(self, cancel=False) -> None:
        self.client.stop_stream(cancel_requests=cancel)
        self.client.close()


def engine_metrics(server: TritonServer) -> dict[str, float]:
    import urllib.request

    with urllib.request.urlopen(server.metrics_url, timeout=10) as r:
        text = r.read().decode()
    return {k: float(v) for k, v in re.findall(r'k3_engine\{model="k3",quantity="(\w+)"\} (\S+)', text)}


def test_concurrent_streams_equal_k3_trt_run_greedy_output(server, reference):
    steps_before = engine_metrics(server).get("steps", 0)
    streams = [Stream(server) for _ in PROMPTS]  # one gRPC stream each, all in flight together
    try:
        for i, (stream, prompt, n) in enumerate(zip(streams, PROMPTS, MAX_TOKENS)):
            stream.send(request(prompt, n), request_id=str(i))
        chunks = [stream.collect([str(i)])[str(i)] for i, stream in enumerate(streams)]
    finally:
        for stream in streams:
            stream.close()
    for got, (ids, text), n in zip(chunks, reference, MAX_TOKENS):
        assert [t for c_ids, _ in got for t in c_ids] == ids
        assert "".join(c_text for _, c_text in got) == text
        assert len(got) == len(ids) > 1  # incremental: one response per generated token
    # Inflight batching: the requests shared steps (one step per token each would be sum(MAX_TOKENS)).
    assert engine_metrics(server)["steps"] - steps_before < sum(MAX_TOKENS)


@pytest.mark.parametrize("inputs, message", [
    (request(max_tokens=4), "give exactly one of 'text_input' (BYTES) or 'input_ids' (INT32)"),
    (request("hi", 0), "'max_tokens' must be >= 1, got 0"),
    (request("hi", np.array([[4.0]], dtype=np.float32)), "input 'max_tokens' data-type is 'FP32', but model 'k3' "
                                                         "expects 'INT32'"),
    (request("x" * 95, 4), "exceeds max_seq_len 96"),
    (request(max_tokens=4, input_ids=np.array([[5, 5000]], dtype=np.int32)), "outside the vocabulary"),
    (request("hi", 4, temperature=np.array([[-1.0]], dtype=np.float32)), "temperature must be >= 0"),
    (request("hi", 4, beam_width=np.array([[2]], dtype=np.int32)), "input 'beam_width': beam search is not supported"),
    (request("hi", 4, lora_task_id=np.array([[3]], dtype=np.uint64)), "input 'lora_task_id': LoRA is not supported"),
], ids=["no-prompt", "max-tokens-0", "max-tokens-fp32", "over-long", "ids-outside-vocab", "bad-temperature",
        "beam-width-2", "lora"])
def test_bad_request_gets_a_clear_error_and_the_next_request_succeeds(server, reference, inputs, message):
    stream = Stream(server)
    try:
        stream.send(inputs, request_id="bad")
        with pytest.raises(Exception, match=re.escape(message)):
            while not stream.next()[3]:
                pass
        stream.send(request(PROMPTS[2], MAX_TOKENS[2], stream=False,
                            exclude_input_in_output=np.array([[True]])), request_id="good")
        chunks = stream.collect(["good"])["good"]
    finally:
        stream.close()
    assert chunks == [reference[2]]  # not streaming: one response with every token


def every_input(prompt, stop_word, x_bias):
    """One request carrying every input of TensorRT-LLM's ensemble that k3-trt serves, at
    non-neutral values, and the others at their neutral ones."""
    def b(values, dtype):  # one batch row
        return np.array([values], dtype=dtype)

    return {
        "text_input": b([prompt.encode()], np.object_), "max_tokens": b([12], np.int32),
        "num_return_sequences": b([1], np.int32), "bad_words": b([b"e", b"", b"ab"], np.object_),
        "stop_words": b([stop_word.encode()], np.object_), "exclude_input_in_output": b([False], np.bool_),
        "end_id": b([2], np.int32), "pad_id": b([0], np.int32), "top_k": b([20], np.int32),
        "top_p": b([0.9], np.float32), "temperature": b([0.8], np.float32), "length_penalty": b([1.0], np.float32),
        "repetition_penalty": b([1.2], np.float32), "min_tokens": b([4], np.int32),
        "presence_penalty": b([0.3], np.float32), "frequency_penalty": b([0.2], np.float32),
        "seed": b([1234], np.uint64), "return_log_probs": b([True], np.bool_),
        "return_context_logits": b([False], np.bool_), "return_generation_logits": b([False], np.bool_),
        "return_perf_metrics": b([False], np.bool_), "return_kv_cache_reuse_stats": b([False], np.bool_),
        "beam_width": b([1], np.int32), "stream": b([False], np.bool_), "prompt_vocab_size": b([0], np.int32),
        "embedding_bias_words": b([b"x", b"yz"], np.object_), "embedding_bias_weights": b([x_bias, -1.0], np.float32),
        "parse_special_tokens": b([False], np.bool_),
    }


def test_one_request_carrying_every_input(server):
    """Through the server, the same tokens and log-probabilities as the engine in this
    process given the same parameters; bad words never appear, the end id not before
    min_tokens, the stop word ends the output, the prompt leads the answer."""
    tok, prompt = ByteTokenizer(), "the quick brown fox"
    engine = build_engine(str(TINY), dtype=torch.float32, device="cpu",
                          **{k: v for k, v in ENGINE.items() if k != "dtype"})
    # The tiny model mostly draws ids past the 256 bytes, which no text names: a bias on
    # "x" makes it likely enough to serve as the stop word, taken with the first bias whose
    # unstopped output (computed here) has its first "x" after a few tokens.
    (x,), (e,), (a, b) = tok.encode("x"), tok.encode("e"), tok.encode("ab")
    for x_bias in np.arange(1.0, 12.0, 0.25):
        probe = parse_request(every_input(prompt, "", x_bias).get, tok)
        free = engine.generate([probe.prompt], probe.sampling)[0]
        out = free.output_token_ids
        if x in out[2:] and x not in out[:2]:
            break
    else:
        pytest.fail("no bias on 'x' puts it in the output after two tokens")
    full = probe.prompt + out
    assert e not in out and (a, b) not in {(full[i - 1], full[i]) for i in range(len(probe.prompt), len(full))}
    assert 2 not in out[:4]  # min_tokens holds back the end id
    cut = out.index(x) + 1
    expected_ids, expected_lps = out[:cut], free.output_log_probs[:cut]

    stream = Stream(server)
    try:
        inputs = [tensor(name, array) for name, array in every_input(prompt, "x", x_bias).items()]
        results = []
        stream.client.async_stream_infer("k3", inputs, request_id="all", enable_empty_final_response=True)
        while True:
            result, error = stream.events.get(timeout=RESPONSE_TIMEOUT_S)
            assert error is None, error
            results.append(result)
            if result.get_response().parameters["triton_final_response"].bool_param:
                break
    finally:
        stream.close()
    answers = [r for r in results if r.get_response().outputs]
    assert len(answers) == 1  # not streaming: one answer
    answer = answers[0]
    prompt_ids = tok.encode(prompt)
    assert answer.as_numpy("output_ids").reshape(-1).tolist() == prompt_ids + expected_ids
    assert answer.as_numpy("text_output").reshape(-1)[0].decode() == prompt + tok.decode(expected_ids)
    log_probs = answer.as_numpy("output_log_probs")
    assert log_probs.shape == (1, 1, len(expected_ids))
    np.testing.assert_allclose(log_probs.reshape(-1), expected_lps, atol=1e-5)
    np.testing.assert_allclose(answer.as_numpy("cum_log_probs").reshape(-1), [sum(expected_lps)], atol=1e-4)
    assert all(lp <= 0 for lp in expected_lps)


def test_cancelling_mid_stream_frees_the_requests_blocks_and_slot(server, reference):
    before = engine_metrics(server)
    stream = Stream(server)
    try:
        stream.send(request(PROMPTS[1], 80), request_id="long")
        for _ in range(3):
            assert not stream.next()[3]
    finally:
        stream.close(cancel=True)
    deadline = time.monotonic() + 30
    while True:
        now = engine_metrics(server)
        if now["cancelled"] == before.get("cancelled", 0) + 1 and now["active_requests"] == 0:
            break
        assert time.monotonic() < deadline, f"the cancelled request is still held: {now}"
        time.sleep(0.05)
    assert now["blocks_in_use"] == 0 and now["slots_in_use"] == 0
    assert now["steps"] - before.get("steps", 0) < 80  # aborted, not run to its end

    stream = Stream(server)
    try:
        stream.send(request(PROMPTS[0], MAX_TOKENS[0]), request_id="after")
        chunks = stream.collect(["after"])["after"]
    finally:
        stream.close()
    assert [t for ids, _ in chunks for t in ids] == reference[0][0]


def test_stop_is_bounded_and_leaves_no_process(server):
    assert leftover_processes(server)  # the server and its stub are there while it runs
    start = time.monotonic()
    code = server.stop(STOP_TIMEOUT_S)
    assert time.monotonic() - start < STOP_TIMEOUT_S
    assert code == 0, "tritonserver did not exit cleanly on SIGINT"
    assert not leftover_processes(server)
    with pytest.raises(ProcessLookupError):
        os.kill(server.process.pid, 0)
