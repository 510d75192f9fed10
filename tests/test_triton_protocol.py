"""The Triton model's logic without Triton: request parsing (TensorRT-LLM tensor names),
response chunks, the model repository, and the engine loop driving the tiny model with
requests from other threads (compared with LLMEngine.generate; greedy, float32)."""
import dataclasses
import re
import threading
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from k3_trtllm.runtime.engine import build_engine
from k3_trtllm.runtime.tokenizer import ByteTokenizer
from k3_trtllm.serve.engine_loop import EngineLoop
from k3_trtllm.serve.protocol import BadRequest, OutputText, ResponseBuilder, parse_request
from k3_trtllm.serve.repository import engine_kwargs_from_parameters, write_model_repository

TINY = Path(__file__).resolve().parents[1] / "examples" / "tiny-k3"
TOK = ByteTokenizer()


def batch(value, dtype):
    return np.array([[value]], dtype=dtype)


def parse(**tensors):
    return parse_request(tensors.get, TOK)


GOOD = {"text_input": batch(b"hi", np.object_), "max_tokens": batch(5, np.int32)}


def test_parse_maps_tensorrt_llm_names_onto_sampling_params():
    req = parse(**GOOD, stream=batch(True, np.bool_), temperature=batch(0.5, np.float32),
                top_k=batch(7, np.int32), top_p=batch(0.25, np.float32), seed=batch(2**40, np.uint64),
                end_id=batch(9, np.int32), stop_words=np.array([[b"ab", b"c"]], dtype=np.object_))
    assert req.prompt == "hi" and req.stream
    s = req.sampling
    assert (s.max_new_tokens, s.temperature, s.top_k, s.top_p, s.seed) == (5, 0.5, 7, 0.25, 2**40)
    assert s.stop_token_ids == (9,) and s.ignore_eos  # end_id replaces the model's EOS
    assert req.stop_sequences == (tuple(TOK.encode("ab")), tuple(TOK.encode("c")))


def test_parse_token_ids_prompt_and_defaults():
    req = parse(input_ids=np.array([[5, 6, 7]], dtype=np.int32), max_tokens=batch(2, np.int32))
    assert req.prompt == [5, 6, 7] and not req.stream and req.stop_sequences == ()
    assert req.sampling.is_greedy and req.sampling.max_new_tokens == 2


@pytest.mark.parametrize("tensors, message", [
    ({"max_tokens": batch(4, np.int32)}, "text_input"),
    ({**GOOD, "input_ids": np.array([[5]], dtype=np.int32)}, "exactly one of"),
    ({"text_input": GOOD["text_input"]}, "'max_tokens' (INT32) is required"),
    ({**GOOD, "max_tokens": batch(0, np.int32)}, "'max_tokens' must be >= 1, got 0"),
    ({**GOOD, "text_input": batch(b"", np.object_)}, "'text_input' is empty"),
    ({**GOOD, "text_input": batch(b"\xff", np.object_)}, "not UTF-8"),
    ({**GOOD, "max_tokens": np.array([[4], [4]], dtype=np.int32)}, "batch size 1"),
    ({**GOOD, "max_tokens": np.array([[4, 5]], dtype=np.int32)}, "'max_tokens' must hold one value"),
    ({**GOOD, "temperature": batch(-1.0, np.float32)}, "temperature must be >= 0"),
    ({**GOOD, "top_p": batch(0.0, np.float32)}, "top_p must be in (0, 1]"),
])
def test_parse_rejects_bad_requests_naming_the_tensor(tensors, message):
    with pytest.raises(BadRequest, match=re.escape(message)):
        parse(**tensors)


def test_output_text_holds_back_a_split_utf8_character_and_drops_eos():
    text = OutputText(TOK)
    e_acute = TOK.encode("é")  # two bytes, two tokens
    assert text.push(TOK.encode("a") + e_acute[:1], finished=False) == "a"
    assert text.push(e_acute[1:], finished=False) == "é"
    assert text.push([2], finished=True, drop_last=True) == ""  # EOS id: in the ids, not in the text
    assert text.shown == "aé" and text.ids[-1] == 2


def test_response_builder_streams_per_step_or_answers_once_and_honours_stop_words():
    ids = TOK.encode("xyz!")
    streaming = ResponseBuilder(parse(**GOOD, stream=batch(True, np.bool_),
                                      stop_words=np.array([[b"yz"]], dtype=np.object_)), TOK)
    chunks = [streaming.add([t], None) for t in ids[:3]]
    assert [(c.ids, c.text, c.final, done) for c, done in chunks] == [
        ([ids[0]], "x", False, False), ([ids[1]], "y", False, False), ([ids[2]], "z", True, True)]

    whole = ResponseBuilder(parse(**GOOD), TOK)
    assert whole.add(ids[:1], None) == (None, False)
    chunk, done = whole.add(ids[1:], "length")
    assert done and chunk.final and chunk.ids == ids and chunk.text == "xyz!"


def test_repository_parameters_round_trip(tmp_path):
    model = write_model_repository(TINY, tmp_path, name="m", max_batch_size=4, dtype="float32", num_blocks=32,
                                   max_slots=4, cache_memory_gb=None, cancellation_check_period_ms=20)
    config = (model / "config.pbtxt").read_text()
    assert "decoupled: true" in config and "max_batch_size: 4" in config
    assert (model / "1" / "model.py").read_text().count("TritonPythonModel") >= 1
    parameters = dict(re.findall(r'key: "(\w+)" value: \{ string_value: "([^"]*)" \}', config))
    model_dir, engine, loop = engine_kwargs_from_parameters(parameters)
    assert model_dir == str(TINY)
    assert engine == {"dtype": torch.float32, "max_batch_size": 4, "num_blocks": 32, "max_slots": 4,
                      "device": "cuda" if torch.cuda.is_available() else "cpu"}
    assert loop == {"cancel_check_period_s": 0.02}
    with pytest.raises(ValueError, match="unknown engine settings"):
        write_model_repository(TINY, tmp_path, block_sizes=4)
    with pytest.raises(ValueError, match="no config.json"):
        write_model_repository(tmp_path, tmp_path)


class RecordingSink:
    """A Sink that collects chunks like the Triton sender would send them."""

    def __init__(self, generation, cancel_after: int | None = None) -> None:
        self.builder = ResponseBuilder(generation, TOK)
        self.chunks, self.errors, self.cancelled = [], [], False
        self.cancel_after = cancel_after
        self.closed = threading.Event()

    def on_tokens(self, new_ids, finish_reason):
        chunk, done = self.builder.add(new_ids, finish_reason)
        if chunk is not None:
            self.chunks.append(chunk)
        if done:
            self.closed.set()
        return done

    def on_error(self, message, client_error=False):
        self.errors.append((message, client_error))
        self.closed.set()

    def on_cancelled(self):
        self.cancelled = True
        self.closed.set()

    def is_cancelled(self):
        return self.cancel_after is not None and len(self.chunks) >= self.cancel_after


@pytest.fixture(scope="module")
def engine():
    return build_engine(str(TINY), dtype=torch.float32, max_batch_size=4, max_seq_len=64, num_blocks=32,
                        max_slots=4)


def request(prompt, max_tokens, **extra):
    return parse(text_input=batch(prompt.encode(), np.object_), max_tokens=batch(max_tokens, np.int32),
                 stream=batch(True, np.bool_), **extra)


def test_engine_loop_streams_requests_from_other_threads_like_generate(engine):
    prompts, lengths = ["a", "hello", "three words here"], [3, 5, 4]
    reqs = [request(p, n) for p, n in zip(prompts, lengths)]
    expected = [r.output_token_ids for r in engine.generate(prompts, [r.sampling for r in reqs])]

    loop = EngineLoop(engine, cancel_check_period_s=0.0)
    loop.start()
    try:
        sinks = [RecordingSink(r) for r in reqs]
        threads = [threading.Thread(target=loop.submit, args=(r, s)) for r, s in zip(reqs, sinks)]
        for t in threads:
            t.start()
        assert all(s.closed.wait(60) for s in sinks)
        assert [[t for c in s.chunks for t in c.ids] for s in sinks] == expected
        assert [len(s.chunks) for s in sinks] == lengths and all(s.chunks[-1].final for s in sinks)

        # A stop word ends a request early; a cancelled one ends without a final chunk.
        stop = tuple(expected[1][1:3])
        stopped = RecordingSink(dataclasses.replace(request("hello", 5), stop_sequences=(stop,)))
        cancelled = RecordingSink(request("hello", 40), cancel_after=2)
        too_long = RecordingSink(request("x" * 60, 10))
        for sink in (stopped, cancelled, too_long):
            loop.submit(sink.builder.generation, sink)
        assert all(s.closed.wait(60) for s in (stopped, cancelled, too_long))
        assert [t for c in stopped.chunks for t in c.ids] == expected[1][:3]
        assert cancelled.cancelled and 2 <= len(cancelled.chunks) < 40 and not cancelled.chunks[-1].final
        assert "exceeds max_seq_len 64" in too_long.errors[0][0] and too_long.errors[0][1]
        wait_until_idle(loop)
        stats = loop.stats()
        assert (stats.active_requests, stats.blocks_in_use, stats.slots_in_use) == (0, 0, 0)
        assert (stats.finished, stats.cancelled, stats.failed) == (4, 1, 1)
    finally:
        loop.stop()


def test_engine_loop_survives_a_failing_step(engine, monkeypatch):
    loop = EngineLoop(engine)
    run = engine.runner.run
    calls = []

    def fail_once(batch_):
        calls.append(1)
        if len(calls) == 1:
            raise RuntimeError("injected")
        return run(batch_)

    monkeypatch.setattr(engine.runner, "run", fail_once)
    loop.start()
    try:
        first, second = RecordingSink(request("ab", 3)), RecordingSink(request("ab", 3))
        loop.submit(first.builder.generation, first)
        assert first.closed.wait(60) and first.errors == [("engine step failed: RuntimeError: injected", False)]
        loop.submit(second.builder.generation, second)
        assert second.closed.wait(60) and not second.errors and len(second.chunks) == 3
        wait_until_idle(loop)
        assert loop.stats().blocks_in_use == 0 and loop.stats().slots_in_use == 0
    finally:
        loop.stop()


def wait_until_idle(loop, timeout_s=30.0):
    deadline = time.monotonic() + timeout_s
    while loop.stats().active_requests and time.monotonic() < deadline:
        time.sleep(0.01)
