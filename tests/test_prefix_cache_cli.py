"""The prefix cache's surfaces (issue 22): the flags of run, bench, serve and triton-repo are
checked in one line before anything loads or is written; `run --json` reports per request
the prompt tokens a cached prefix covered, as many as the chain hashes and the snapshot
interval predict (`expected_cached`, computed here from the prompts alone), with exactly
the tokens of `--no-prefix-cache` (tiny K3, fp32, CPU; at world size 1 and 2); `bench`
prints the engine's prefix-cache block; the Triton model publishes queries, hits and cached
tokens as metrics on the server's metrics endpoint; segmented engine dirs take it too."""
from __future__ import annotations

import json
import random
import re

import numpy as np
import pytest
import torch
from click.testing import CliRunner

from k3_trtllm.cli import main
from k3_trtllm.convert import convert_checkpoint

from test_triton_server import TINY, Stream, engine_metrics, running_server  # noqa: I001  (tests/ is on sys.path)

BLOCK, INTERVAL = 8, 16
POOL = ["--dtype", "float32", "--device", "cpu", "--block-size", str(BLOCK), "--max-seq-len", "96",
        "--num-blocks", "64", "--max-slots", "2"]
CACHE = ["--prefix-cache", "--prefix-cache-interval", str(INTERVAL), "--prefix-cache-snapshots", "8"]


def invoke(*args):
    return CliRunner().invoke(main, [str(a) for a in args])


def expected_cached(prompt: list[int], earlier: list[list[int]], block: int = BLOCK, interval: int = INTERVAL) -> int:
    """Prompt tokens a hit covers when ``earlier`` prompts ran (one at a time) before it: the
    deepest multiple of the interval within the full blocks ``prompt`` shares with one of
    them (snapshots are taken on interval boundaries of a prefill), short of the prompt's
    last token (it always runs, for its logits)."""
    def common(a, b):
        n = 0
        while n < min(len(a), len(b)) and a[n] == b[n]:
            n += 1
        return n

    best = 0
    for other in earlier:  # its prefill ended a step at every interval boundary, taking a snapshot
        shared = common(prompt, other) // block * block
        best = max(best, min(shared, len(prompt) - 1) // interval * interval)
    return best


def prompts_with_shared_prefix(prefix_len: int, suffix_lens: list[int], seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    prefix = [rng.randrange(3, 1000) for _ in range(prefix_len)]
    return [prefix + [rng.randrange(3, 1000) for _ in range(n)] for n in suffix_lens]


def ids_arg(ids: list[int]) -> str:
    return ",".join(map(str, ids))


@pytest.mark.parametrize("args, message", [
    (["--prefix-cache", "--prefix-cache-interval", "12"], "--prefix-cache-interval 12 must be a positive multiple "
                                                          "of the block size 8 (or 0 for the default"),
    (["--prefix-cache", "--prefix-cache-interval", "96"], "--prefix-cache-interval 96: no request reaches a "
                                                          "snapshot (--max-seq-len 96)"),
    (["--no-prefix-cache", "--prefix-cache-interval", "16"], "--prefix-cache-interval: needs --prefix-cache"),
    (["--no-prefix-cache", "--prefix-cache-snapshots", "4"], "--prefix-cache-snapshots: needs --prefix-cache"),
])
@pytest.mark.parametrize("command", ["run", "bench", "triton-repo"])
def test_bad_prefix_cache_flags_fail_in_one_line_before_anything_is_written(tmp_path, command, args, message):
    where = {"run": ["--prompt-ids", "5,6"], "bench": ["--num-requests", "1"],
             "triton-repo": [tmp_path / "repo"]}[command]
    result = invoke(command, TINY, *where, *POOL, *args)
    assert result.exit_code == 1, result.output
    assert result.output.startswith(f"Error: {message}")
    assert len(result.output.strip().splitlines()) == 1 and "Traceback" not in result.output
    assert not (tmp_path / "repo").exists()


@pytest.mark.parametrize("command", ["run", "triton-repo"])
def test_snapshot_count_is_bounded(tmp_path, command):
    where = ["--prompt-ids", "5,6"] if command == "run" else [tmp_path / "repo"]
    result = invoke(command, TINY, *where, *POOL, "--prefix-cache", "--prefix-cache-snapshots", "0")
    assert result.exit_code == 2 and "Invalid value for '--prefix-cache-snapshots'" in result.output
    assert not (tmp_path / "repo").exists()


def test_snapshot_rows_beside_given_pools_are_stated_on_stderr_and_in_the_json():
    """--num-blocks and --max-slots without a budget: the snapshot rows the cache adds are memory the
    user did not size, so their count and MiB are one stderr line and the JSON's snapshot_bytes."""
    from k3_trtllm.model import K3Caches, load_model

    row = K3Caches.bytes_per_slot(load_model(TINY, dtype=torch.float32).config, torch.float32)
    base = ["run", TINY, "--prompt-ids", "5,6,7", "--max-new-tokens", 1, "--json", *POOL]
    result = invoke(*base, "--prefix-cache", "--prefix-cache-interval", INTERVAL)
    assert result.exit_code == 0, result.output
    # --max-slots 2 and 64 blocks of 8 (32 intervals of 16): 2 rows
    def notices(result):  # the tiny model's tokenizer warning goes to stderr too
        return [line for line in result.stderr.splitlines() if line.startswith("k3-trt: prefix cache")]

    assert notices(result) == [
        f"k3-trt: prefix cache: 2 KDA state snapshot rows ({2 * row / 2**20:.1f} MiB per rank) beside "
        f"--num-blocks 64 / --max-slots 2 (one per state slot, at most one per --prefix-cache-interval 16 of the "
        f"blocks); --prefix-cache-snapshots N sets them, --no-prefix-cache drops them"]
    block = json.loads(result.stdout)["totals"]["prefix_cache"]
    assert block["snapshot_slots"] == 2 and block["snapshot_bytes"] == 2 * row
    # rows the user sized (the flag, or a budget) or none at all: nothing to say
    for flags in (CACHE, ["--no-prefix-cache"], ["--prefix-cache", "--cache-memory-gb", "0.01"]):
        result = invoke(*base, *flags)
        assert result.exit_code == 0 and notices(result) == [], result.output
    assert json.loads(invoke(*base, *CACHE).stdout)["totals"]["prefix_cache"]["snapshot_bytes"] == 8 * row
    # --quiet: nothing but the JSON's field says it
    quiet = invoke(*base, "--quiet", "--prefix-cache", "--prefix-cache-interval", INTERVAL)
    assert quiet.exit_code == 0 and notices(quiet) == []
    assert json.loads(quiet.stdout)["totals"]["prefix_cache"]["snapshot_bytes"] == 2 * row


def run_json(prompts: list[list[int]], *flags) -> dict:
    # --max-batch-size 1: each request starts after the one before finished, so its prefix is cached
    args = ["run", TINY, *[a for p in prompts for a in ("--prompt-ids", ids_arg(p))], "--max-new-tokens", 6,
            "--json", "--quiet", "--max-batch-size", 1, *POOL, *flags]
    result = invoke(*args)
    assert result.exit_code == 0, result.output
    return json.loads(result.stdout)


def test_run_json_reports_cached_tokens_and_the_tokens_of_no_prefix_cache():
    # shared prefixes shorter than, equal to and longer than the interval (40: not a multiple of it)
    prompts = prompts_with_shared_prefix(40, [5, 9])  # shares 5 full blocks: the snapshot at 32 is reused
    prompts.append(prompts[0][:16] + [7, 8, 9])  # 2 shared blocks = exactly one interval
    prompts.append(prompts[0][:12] + [7, 8, 9, 10])  # 1 shared block: under one interval, no hit
    prompts.append(list(prompts[1]))  # the same prompt again: up to its last snapshot short of the end
    on = run_json(prompts, *CACHE)
    off = run_json(prompts, "--no-prefix-cache")
    assert [o["output_ids"] for o in on["outputs"]] == [o["output_ids"] for o in off["outputs"]]
    expected = [expected_cached(p, prompts[:i]) for i, p in enumerate(prompts)]
    assert expected == [0, 32, 16, 0, 48]  # the predictor, by hand
    assert [o["cached_tokens"] for o in on["outputs"]] == expected
    assert [o["cached_tokens"] for o in off["outputs"]] == [0] * len(prompts)
    block = on["totals"]["prefix_cache"]
    assert block["enabled"] is True and block["interval"] == INTERVAL
    assert block["queries"] == len(prompts) and block["hits"] == 3 and block["cached_tokens"] == sum(expected)
    assert off["totals"]["prefix_cache"]["enabled"] is False and off["totals"]["prefix_cache"]["hits"] == 0
    # the cache skipped the covered tokens: the model ran that many fewer
    assert off["totals"]["computed_tokens"] - on["totals"]["computed_tokens"] == sum(expected)


def test_run_at_world_size_2_hits_like_world_size_1():
    # every rank restores its own heads' snapshots; rank 0 decides the hits
    prompts = prompts_with_shared_prefix(40, [5, 9], seed=2)
    on = run_json(prompts, "--tp", 2, *CACHE)
    off = run_json(prompts, "--tp", 2, "--no-prefix-cache")
    assert [o["output_ids"] for o in on["outputs"]] == [o["output_ids"] for o in off["outputs"]]
    assert [o["cached_tokens"] for o in on["outputs"]] == [0, expected_cached(prompts[1], prompts[:1])] == [0, 32]


def test_bench_prints_the_prefix_cache_block():
    args = ["bench", TINY, "--num-requests", 3, "--prompt-len", 5, "--output-len", 2, "--warmup", 0,
            "--shared-prefix-len", 40, "--quiet", "--max-batch-size", 1, *POOL]
    on = invoke(*args, *CACHE)
    assert on.exit_code == 0, on.output
    report = json.loads(on.stdout)
    block = report["prefix_cache"]
    assert block["enabled"] is True and block["queries"] == 3 and block["hits"] == 2
    # prompts of 45 tokens whose first 40 are shared
    assert block["cached_tokens"] == 2 * expected_cached([1] * 40 + [2] * 5, [[1] * 40 + [3] * 5]) == 64
    assert report["config"]["shared_prefix_len"] == 40 and report["config"]["prefix_cache"] is True
    off = invoke(*args, "--no-prefix-cache")
    assert off.exit_code == 0, off.output
    assert json.loads(off.stdout)["prefix_cache"]["hits"] == 0


def test_bench_refuses_requests_longer_than_max_seq_len_before_running():
    result = invoke("bench", TINY, "--num-requests", 2, "--prompt-len", "5:9", "--output-len", 4, "--warmup", 0,
                    "--shared-prefix-len", 90, "--quiet", *POOL, *CACHE)
    assert result.exit_code == 1 and result.stdout == ""
    assert result.stderr.strip().splitlines() == ["Error: --shared-prefix-len 90 + --prompt-len max 9 + --output-len max "
                                                  "4 = 103 tokens exceeds --max-seq-len 96"]


@pytest.fixture(scope="module")
def engine_dir(tmp_path_factory):
    root = tmp_path_factory.mktemp("prefix-engine-dir")
    convert_checkpoint(TINY, root / "ckpt", progress=False)
    result = CliRunner().invoke(main, ["build", str(root / "ckpt"), str(root / "engine"), "--layout", "segments",
                                       "--builder", "none", "--quiet", "--dtype", "float32", "--max-batch-size", "2",
                                       "--max-seq-len", "96", "--block-size", str(BLOCK), "--max-num-tokens", "64"])
    assert result.exit_code == 0, result.output
    return root / "engine"


def test_engine_dir_takes_the_prefix_cache_with_the_tokens_of_no_prefix_cache(engine_dir):
    # the segments run unchanged; the snapshots are copies beside their pools (EngineExecutor)
    prompts = prompts_with_shared_prefix(40, [5, 9], seed=3)
    args = [a for p in prompts for a in ("--prompt-ids", ids_arg(p))]
    runs = {}
    for flags in (CACHE, ["--no-prefix-cache"]):
        result = invoke("run", engine_dir, *args, "--device", "cpu", "--max-new-tokens", 4, "--json", "--quiet",
                        "--max-batch-size", 1, "--num-blocks", 24, "--max-slots", 2, *flags)
        assert result.exit_code == 0, result.output
        runs[flags[0]] = json.loads(result.stdout)["outputs"]
    on, off = runs["--prefix-cache"], runs["--no-prefix-cache"]
    assert [o["output_ids"] for o in on] == [o["output_ids"] for o in off]
    assert [o["cached_tokens"] for o in on] == [0, expected_cached(prompts[1], prompts[:1])] == [0, 32]


def test_world2_engine_dir_hits_with_the_tokens_of_no_prefix_cache(tmp_path):
    # tp2/ep2 over gloo: each rank's KDA segment writes its own heads' snapshots into its own pools
    convert_checkpoint(TINY, tmp_path / "ckpt", 2, 2, progress=False)
    build = invoke("build", tmp_path / "ckpt", tmp_path / "engine", "--layout", "segments", "--builder", "none",
                   "--quiet", "--dtype", "float32", "--max-batch-size", "2", "--max-seq-len", "96", "--block-size",
                   BLOCK, "--max-num-tokens", "64")
    assert build.exit_code == 0, build.output
    prompts = prompts_with_shared_prefix(40, [5, 9], seed=4)
    args = [a for p in prompts for a in ("--prompt-ids", ids_arg(p))]
    runs = {}
    for flags in (CACHE, ["--no-prefix-cache"]):
        result = invoke("run", tmp_path / "engine", *args, "--device", "cpu", "--max-new-tokens", 4, "--json",
                        "--quiet", "--max-batch-size", 1, "--num-blocks", 24, "--max-slots", 2, *flags)
        assert result.exit_code == 0, result.output
        runs[flags[0]] = json.loads(result.stdout)["outputs"]
    on, off = runs["--prefix-cache"], runs["--no-prefix-cache"]
    assert [o["output_ids"] for o in on] == [o["output_ids"] for o in off]
    assert [o["cached_tokens"] for o in on] == [0, expected_cached(prompts[1], prompts[:1])] == [0, 32]


def test_engine_dir_flags_are_checked_against_its_own_block_size(engine_dir, tmp_path):
    for command, where in (("run", ["--prompt-ids", "5,6", "--device", "cpu"]), ("triton-repo", [tmp_path / "r"])):
        result = invoke(command, engine_dir, *where, "--prefix-cache", "--prefix-cache-interval", 12)
        assert result.exit_code == 1 and result.output.startswith(
            "Error: --prefix-cache-interval 12 must be a positive multiple of the block size 8"), result.output
    assert not (tmp_path / "r").exists()
    ok = invoke("triton-repo", engine_dir, tmp_path / "ok", "--prefix-cache", "--prefix-cache-interval", 16)
    assert ok.exit_code == 0, ok.output
    pbtxt = (tmp_path / "ok" / "k3" / "config.pbtxt").read_text()
    assert 'key: "prefix_cache" value: { string_value: "True" }' in pbtxt
    assert 'key: "prefix_cache_interval" value: { string_value: "16" }' in pbtxt
    # the engine's KDA plugins write the snapshots mid-prefill: the cache is on by default, as for a
    # checkpoint; an engine dir built before they did takes it only when asked for (a default-on cache
    # would cut its every prefill at the snapshot positions)
    from test_prefix_cache import pre_snapshot_engine_dir

    old = pre_snapshot_engine_dir(engine_dir, tmp_path / "old-engine")
    for name, where, flags, on in (("default", engine_dir, [], True), ("off", engine_dir, ["--no-prefix-cache"], False),
                                   ("old", old, [], False), ("old-asked", old, ["--prefix-cache"], True)):
        result = invoke("triton-repo", where, tmp_path / name, *flags)
        assert result.exit_code == 0, result.output
        pbtxt = (tmp_path / name / "k3" / "config.pbtxt").read_text()
        assert ('key: "prefix_cache" value: { string_value: "True" }' in pbtxt) is on, name
        assert on or "prefix_cache" not in pbtxt


def test_engine_dir_snapshot_rows_are_bounded_by_its_blocks(engine_dir):
    # 2 sequences of 96 tokens in blocks of 8: 24 blocks, so at most 24 snapshot rows are ever usable
    result = invoke("run", engine_dir, "--prompt-ids", "5,6", "--device", "cpu", "--prefix-cache-snapshots", 25)
    assert result.exit_code == 1 and result.output.strip().splitlines() == [
        f"Error: cannot run {engine_dir}: --prefix-cache-snapshots 25: the engine binds at most 24 snapshot rows "
        "(its max_num_blocks: a held snapshot needs a cached block of its own)"], result.output


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    work = tmp_path_factory.mktemp("triton-prefix")
    result = invoke("triton-repo", TINY, work / "repo", *POOL, *CACHE, "--cancellation-check-period-ms", 10)
    assert result.exit_code == 0, result.output
    pbtxt = (work / "repo" / "k3" / "config.pbtxt").read_text()
    parameters = dict(re.findall(r'key: "(\w+)" value: \{ string_value: "([^"]*)" \}', pbtxt))
    assert parameters["prefix_cache"] == "True" and parameters["prefix_cache_interval"] == str(INTERVAL)
    assert parameters["snapshot_slots"] == "8"
    with running_server(work / "repo", work) as srv:
        yield srv


def test_triton_metrics_count_prefix_cache_queries_hits_and_cached_tokens(server):
    from test_triton_server import request

    prompts = prompts_with_shared_prefix(40, [5, 9], seed=1)
    before = engine_metrics(server)
    assert before["prefix_cache_queries"] == before["prefix_cache_hits"] == before["cached_tokens"] == 0
    outputs = []
    stream = Stream(server)
    try:
        for i, ids in enumerate(prompts):  # one after the other: the second finds the first's prefix
            stream.send(request(max_tokens=4, input_ids=np.array([ids], dtype=np.int32)), request_id=str(i))
            outputs.append([t for c, _ in stream.collect([str(i)])[str(i)] for t in c])
    finally:
        stream.close()
    after = engine_metrics(server)
    assert after["prefix_cache_queries"] == 2 and after["prefix_cache_hits"] == 1
    assert after["cached_tokens"] == expected_cached(prompts[1], prompts[:1]) == 32
    # and the cached request's tokens are those of the uncached engine
    off = run_json(prompts, "--no-prefix-cache", "--max-new-tokens", 4)
    assert outputs == [o["output_ids"] for o in off["outputs"]]
