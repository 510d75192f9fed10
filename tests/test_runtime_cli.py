"""``k3-trt run`` and ``k3-trt bench`` on the tiny checkpoint, in process."""
import json

import pytest
import torch
from click.testing import CliRunner

from k3_trtllm.cli import main
from k3_trtllm.model import K3Caches, load_model
from k3_trtllm.runtime.engine import EngineConfig, LLMEngine
from k3_trtllm.runtime.executor import TorchExecutor
from k3_trtllm.runtime.sequence import SamplingParams

POOL = ["--dtype", "float32", "--device", "cpu", "--num-blocks", "64", "--max-slots", "4", "--block-size", "8"]


@pytest.fixture(scope="module")
def ckpt(ckpt_dir):
    return str(ckpt_dir("tiny"))


def invoke(*args):
    return CliRunner().invoke(main, [str(a) for a in args], catch_exceptions=False)


def test_run_json_matches_the_engine_and_honours_per_line_sampling(ckpt, tmp_path):
    prompts_file = tmp_path / "prompts.jsonl"
    prompts_file.write_text('{"prompt_ids": [40, 50, 60, 70], "max_new_tokens": 2}\n\n'
                            '{"prompt": "hi", "stop_token_ids": [1023]}\n')
    res = invoke("run", ckpt, "--prompt", "hello", "--prompt-ids", "5, 6,7", "--prompts-file", prompts_file,
                 "--max-new-tokens", 5, "--json", *POOL)
    assert res.exit_code == 0, res.output
    report = json.loads(res.stdout)  # progress goes to stderr
    outs = report["outputs"]
    assert [o["prompt_ids"] for o in outs] == [[107, 104, 111, 111, 114], [5, 6, 7], [40, 50, 60, 70], [107, 108]]
    for o, n in zip(outs, (5, 5, 2, 5)):  # the file's max_new_tokens overrides the flag
        assert len(o["output_ids"]) == n if o["finish_reason"] == "length" else len(o["output_ids"]) < n
    assert report["totals"]["blocks"]["in_use"] == 0 and report["totals"]["slots"]["in_use"] == 0
    # The same prompts through the library API, one at a time.
    model = load_model(ckpt, dtype=torch.float32)
    for o, n in zip(outs, (5, 5, 2, 5)):
        caches = K3Caches.allocate(model.config, 64, 8, 1, torch.float32)
        engine = LLMEngine(TorchExecutor(model, caches, "cpu"), EngineConfig(64, 1, 8, 1, 64),
                           eos_token_ids=(model.config.eos_token_id,))
        assert engine.generate([o["prompt_ids"]], SamplingParams(max_new_tokens=n))[0].output_token_ids == \
            o["output_ids"]
        assert o["ttft_s"] > 0


def test_run_stream_prints_pieces_per_request(ckpt):
    args = ["run", ckpt, "--prompt", "hello", "--prompt", "a longer prompt", "--max-new-tokens", 24, *POOL]
    streamed = invoke(*args, "--stream")
    assert streamed.exit_code == 0, streamed.output
    pieces = {0: "", 1: ""}
    ends = []
    for line in streamed.stdout.split("\n")[:-1]:  # the stream is stdout; stderr has warnings
        if line.startswith("[") and "] " in line:
            index, piece = line[1:].split("] ", 1)
            if piece.startswith("<") and piece.endswith(">"):
                ends.append(int(index))
            else:
                pieces[int(index)] += piece
        else:  # a generated newline continues the previous piece
            pieces[int(index)] += "\n" + line
    assert sorted(ends) == [0, 1]
    final = json.loads(invoke(*args, "--json").stdout)["outputs"]
    assert [pieces[0], pieces[1]] == [final[0]["text"], final[1]["text"]]


@pytest.mark.parametrize("args, code, message", [
    ([], 2, "give at least one prompt"),
    (["--prompt-ids", "1,x"], 2, "comma-separated integers"),
    (["--prompt-ids", "1,100000"], 1, "outside the vocabulary"),
    (["--prompt", "x", "--top-p", "0"], 2, "--top-p"),
    (["--prompt", "x", "--num-blocks", "1"], 1, "latent cache holds 8"),
])
def test_run_rejects_bad_input(ckpt, args, code, message):
    res = invoke("run", ckpt, *POOL, *args)
    assert res.exit_code == code and message in res.output


def test_run_rejects_bad_prompts_file(ckpt, tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt": "ok"}\n{"prompt": "x", "temprature": 1}\n')
    res = invoke("run", ckpt, "--prompts-file", bad, *POOL)
    assert res.exit_code == 1 and "bad.jsonl:2: unknown keys ['temprature']" in res.output


def test_bench_reports_throughput_latency_and_scheduler_time(ckpt):
    res = invoke("bench", ckpt, "--num-requests", 6, "--arrival-rate", 200, "--prompt-len", "2:9",
                 "--output-len", "3", *POOL)
    assert res.exit_code == 0, res.output
    report = json.loads(res.stdout)
    assert report["requests"] == 6 and report["generated_tokens"] == 18
    assert report["output_tokens_per_s"] > 0 and report["ttft_ms"]["p99"] >= report["ttft_ms"]["p50"] > 0
    assert report["tpot_ms"]["mean"] > 0 and report["scheduler_cpu_ms_per_step"]["mean"] > 0
    assert report["blocks"]["in_use"] == 0 and report["config"]["arrival_rate"] == 200


@pytest.mark.parametrize("command", ["run", "bench", "serve"])
@pytest.mark.parametrize("device, cuda_count, message", [
    ("cuda", 0, "--device cuda: "),
    ("cuda:3", 0, "--device cuda:3: "),
    ("cuda:3", 1, "--device cuda:3: this machine has 1 CUDA device (cuda:0 to cuda:0)"),
    ("cuda:x", 1, "--device cuda:x: not a device"),
])
def test_unavailable_device_is_a_one_line_error(ckpt, monkeypatch, command, device, cuda_count, message):
    """No CUDA (or no such index) on this machine, as torch reports it: exit 1 with one line
    naming the device, before any model loading or server start, on every command."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: cuda_count > 0)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: cuda_count)
    extra = ["--prompt", "x"] if command == "run" else []
    res = CliRunner().invoke(main, [command, ckpt, "--device", device, *extra], catch_exceptions=False)
    assert res.exit_code == 1, res.output
    assert res.stdout == "" and res.stderr.startswith("Error: " + message) and res.stderr.count("\n") == 1, \
        res.stderr
    assert "Traceback" not in res.output
