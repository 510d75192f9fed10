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
from k3_trtllm.serve.protocol import BadRequest, OutputText, ResponseBuilder, output_arrays, parse_request
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
    assert req.prompt == TOK.encode("hi") and req.stream
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

    # Not streaming: one answer, led by the prompt unless exclude_input_in_output (TensorRT-LLM's default).
    whole = ResponseBuilder(parse(**GOOD), TOK)
    assert whole.add(ids[:1], None) == (None, False)
    chunk, done = whole.add(ids[1:], "length")
    assert done and chunk.final and chunk.ids == TOK.encode("hi") + ids and chunk.text == "hixyz!"
    excluded = ResponseBuilder(parse(**GOOD, exclude_input_in_output=batch(True, np.bool_)), TOK)
    chunk, done = excluded.add(ids, "length")
    assert done and chunk.ids == ids and chunk.text == "xyz!"


EVERY_INPUT = {
    "text_input": batch(b"hi", np.object_), "max_tokens": batch(6, np.int32),
    "num_return_sequences": batch(1, np.int32), "bad_words": np.array([[b"q", b"", b"rs"]], dtype=np.object_),
    "stop_words": np.array([[b"xy", b""]], dtype=np.object_), "exclude_input_in_output": batch(True, np.bool_),
    "end_id": batch(7, np.int32), "pad_id": batch(0, np.int32), "top_k": batch(4, np.int32),
    "top_p": batch(0.5, np.float32), "temperature": batch(0.75, np.float32), "length_penalty": batch(1.0, np.float32),
    "repetition_penalty": batch(1.25, np.float32), "min_tokens": batch(2, np.int32),
    "presence_penalty": batch(0.5, np.float32), "frequency_penalty": batch(0.25, np.float32),
    "seed": batch(11, np.uint64), "return_log_probs": batch(True, np.bool_),
    "return_context_logits": batch(False, np.bool_), "return_generation_logits": batch(False, np.bool_),
    "return_perf_metrics": batch(False, np.bool_), "return_kv_cache_reuse_stats": batch(False, np.bool_),
    "beam_width": batch(1, np.int32), "stream": batch(True, np.bool_), "prompt_vocab_size": batch(0, np.int32),
    "embedding_bias_words": np.array([[b"a", b"bc"]], dtype=np.object_),
    "embedding_bias_weights": np.array([[1.5, -2.0]], dtype=np.float32),
    "parse_special_tokens": batch(False, np.bool_),
}


def test_parse_serves_every_sampler_input_of_the_ensemble():
    req = parse(**EVERY_INPUT)
    s = req.sampling
    assert (s.max_new_tokens, s.temperature, s.top_k, s.top_p, s.seed) == (6, 0.75, 4, 0.5, 11)
    assert (s.repetition_penalty, s.presence_penalty, s.frequency_penalty, s.min_tokens) == (1.25, 0.5, 0.25, 2)
    assert s.stop_token_ids == (7,) and s.ignore_eos and s.logprobs
    assert s.bad_words == (tuple(TOK.encode("q")), tuple(TOK.encode("rs")))  # empty strings skipped
    a, b, c = TOK.encode("abc")
    assert s.logit_bias == ((a, 1.5), (b, -2.0), (c, -2.0))  # each token of a word gets its weight
    assert req.stop_sequences == (tuple(TOK.encode("xy")),)
    assert req.exclude_input_in_output and req.return_log_probs and req.stream


def test_parse_accepts_older_input_names_once():
    req = parse(**GOOD, random_seed=batch(5, np.uint64), min_length=batch(3, np.int32))
    assert (req.sampling.seed, req.sampling.min_tokens) == (5, 3)
    with pytest.raises(BadRequest, match="give one of 'seed' or 'random_seed'"):
        parse(**GOOD, seed=batch(1, np.uint64), random_seed=batch(1, np.uint64))


@pytest.mark.parametrize("name, value, message", [
    ("beam_width", batch(2, np.int32), "input 'beam_width': beam search is not supported"),
    ("num_return_sequences", batch(3, np.int32), "input 'num_return_sequences'"),
    ("return_generation_logits", batch(True, np.bool_), "input 'return_generation_logits'"),
    ("return_context_logits", batch(True, np.bool_), "input 'return_context_logits'"),
    ("return_perf_metrics", batch(True, np.bool_), "input 'return_perf_metrics'"),
    ("lora_task_id", batch(1, np.uint64), "input 'lora_task_id': LoRA is not supported"),
    ("lora_weights", np.zeros((1, 2, 2), np.float16), "input 'lora_weights': LoRA"),
    ("lora_config", np.zeros((1, 1, 3), np.int32), "input 'lora_config': LoRA"),
    ("prompt_embedding_table", np.zeros((1, 2, 2), np.float16), "input 'prompt_embedding_table': prompt tables"),
    ("prompt_table_extra_id", batch(1, np.uint64), "input 'prompt_table_extra_id'"),
    ("prompt_vocab_size", batch(4, np.int32), "input 'prompt_vocab_size'"),
    ("guided_decoding_guide_type", batch(b"json", np.object_), "input 'guided_decoding_guide_type'"),
    ("guided_decoding_guide", batch(b"{}", np.object_), "input 'guided_decoding_guide'"),
    ("decoder_text_input", batch(b"x", np.object_), "input 'decoder_text_input'"),
    ("repetition_penalty", batch(0.0, np.float32), "repetition_penalty must be finite and > 0"),
    ("min_tokens", batch(-1, np.int32), "min_tokens must be >= 0"),
    ("embedding_bias_weights", np.array([[1.0]], np.float32), "has 0 words but 'embedding_bias_weights' 1"),
])
def test_parse_refuses_what_k3_trt_does_not_do_naming_the_input(name, value, message):
    with pytest.raises(BadRequest, match=re.escape(message)):
        parse(**GOOD, **{name: value})


def test_every_ensemble_input_is_declared():
    """The inputs of tensorrtllm_backend's ensemble config.pbtxt (r25.05, plus older names)."""
    ensemble = ("text_input decoder_text_input max_tokens num_return_sequences bad_words stop_words "
                "exclude_input_in_output end_id pad_id top_k top_p temperature length_penalty repetition_penalty "
                "min_tokens presence_penalty frequency_penalty seed return_log_probs return_context_logits "
                "return_generation_logits return_perf_metrics beam_width stream prompt_embedding_table "
                "prompt_table_extra_id prompt_vocab_size embedding_bias_words embedding_bias_weights lora_task_id "
                "lora_weights lora_config guided_decoding_guide_type guided_decoding_guide "
                "min_length random_seed return_kv_cache_reuse_stats").split()
    from k3_trtllm.serve.protocol import INPUTS, OUTPUTS

    assert set(ensemble) <= set(INPUTS)
    assert {"text_output", "cum_log_probs", "output_log_probs"} <= set(OUTPUTS)


def test_response_builder_returns_log_probs_per_chunk_and_their_running_sum():
    ids = TOK.encode("abc")
    lps = [-0.5, -1.0, -0.25]
    streaming = ResponseBuilder(parse(**GOOD, stream=batch(True, np.bool_), return_log_probs=batch(True, np.bool_)),
                                TOK)
    chunks = [streaming.add([t], "length" if i == 2 else None, [lp])[0] for i, (t, lp) in enumerate(zip(ids, lps))]
    assert [(c.log_probs, c.cum_log_prob) for c in chunks] == [([-0.5], -0.5), ([-1.0], -1.5), ([-0.25], -1.75)]
    arrays = output_arrays(chunks[1])
    assert arrays["output_log_probs"].shape == (1, 1, 1) and arrays["cum_log_probs"].tolist() == [[-1.5]]
    whole = ResponseBuilder(parse(**GOOD, return_log_probs=batch(True, np.bool_)), TOK)
    whole.add(ids[:2], None, lps[:2])
    chunk, _ = whole.add(ids[2:], "length", lps[2:])
    assert chunk.log_probs == lps and chunk.cum_log_prob == -1.75  # the generated tokens only, not the echo
    assert "cum_log_probs" not in output_arrays(ResponseBuilder(parse(**GOOD), TOK).add(ids, "length")[0])


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

    def on_tokens(self, new_ids, finish_reason, new_log_probs=None):
        chunk, done = self.builder.add(new_ids, finish_reason, new_log_probs)
        if chunk is not None:
            self.chunks.append(chunk)
        if done:
            self.closed.set()
        return done

    def on_error(self, message, kind="internal"):
        self.errors.append((message, kind))
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
        assert "exceeds max_seq_len 64" in too_long.errors[0][0] and too_long.errors[0][1] == "client"
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
        assert first.closed.wait(60) and first.errors == [("engine step failed: RuntimeError: injected", "internal")]
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


def test_config_pbtxt_parses_as_a_triton_model_config_and_paths_cannot_inject(tmp_path):
    """Read back with Triton's own ModelConfig proto: every input and output declared, and
    a model path with quotes, backslashes and newlines stays one parameter value."""
    from google.protobuf import text_format
    from tritonclient.grpc import model_config_pb2

    from k3_trtllm.serve.protocol import INPUTS, OUTPUTS

    weird = tmp_path / 'm"odel\\ } parameters { key: "x\nnext'
    weird.mkdir()
    (weird / "config.json").write_bytes((TINY / "config.json").read_bytes())
    model = write_model_repository(weird, tmp_path / "repo", name="k3-tiny_1.0", dtype="float32")
    config = text_format.Parse((model / "config.pbtxt").read_text(), model_config_pb2.ModelConfig())
    assert config.name == "k3-tiny_1.0" and config.model_transaction_policy.decoupled
    assert set(config.parameters) == {"model_dir", "max_batch_size", "dtype"}
    assert config.parameters["model_dir"].string_value == str(weird.resolve())
    dtypes = {i.name: model_config_pb2.DataType.Name(i.data_type) for i in config.input}
    assert dtypes == {name: dtype for name, (dtype, _, _) in INPUTS.items()}
    assert [i.name for i in config.input if not i.optional] == ["max_tokens"]
    assert {o.name: list(o.dims) for o in config.output} == {name: dims for name, (_, dims) in OUTPUTS.items()}


@pytest.mark.parametrize("name", ["", "a/b", ".hidden", "-x", 'k3" } x {', "a\nb", "a b", "x" * 101, "..", "é"])
def test_model_names_outside_tritons_safe_set_are_refused(tmp_path, name):
    with pytest.raises(ValueError, match="model name"):
        write_model_repository(TINY, tmp_path / "repo", name=name)
    assert not (tmp_path / "repo").exists()


def test_engine_loop_drains_in_flight_requests_when_asked(engine):
    drain, drained = threading.Event(), threading.Event()
    loop = EngineLoop(engine, should_drain=drain.is_set, on_drained=drained.set)
    loop.start()
    try:
        long = RecordingSink(request("hello", 50))
        loop.submit(long.builder.generation, long)
        deadline = time.monotonic() + 60
        while not long.chunks and time.monotonic() < deadline:
            time.sleep(0.01)
        assert long.chunks, "the request never started"
        asked = time.monotonic()
        drain.set()
        assert long.closed.wait(10) and drained.wait(10)
        assert time.monotonic() - asked < 1.5
        assert long.errors == [("server shutting down", "unavailable")] and len(long.chunks) < 50
        late = RecordingSink(request("a", 2))
        loop.submit(late.builder.generation, late)  # after draining: refused at once, never queued
        assert late.errors == [("server shutting down", "unavailable")]
        assert (engine.scheduler.blocks.num_used, engine.scheduler.slots.num_used) == (0, 0)
    finally:
        loop.stop()
