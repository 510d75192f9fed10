"""bench/prefix_cache_ttft.py at tiny dims on CPU (issue 22): besides the hit and the one-chunk
uncached run it times the request uncached with its prefill cut at the hit's position, the same
chunk as the hit computes; with an interval on the 64-token grid the snapshot the cold prefill
wrote mid-chunk is exactly that first chunk's final state, so here (tiny TP1 dims, seed 0, where
no CPU kernel's per-token result depends on the chunk's length) the hit's first-token logits are
bitwise those of the cut run: caching alone changes nothing."""
from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))  # the bench imports rank_slice beside it
_spec = importlib.util.spec_from_file_location("prefix_cache_ttft", ROOT / "bench" / "prefix_cache_ttft.py")
ttft = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(ttft)


def test_the_hit_is_bitwise_the_uncached_run_cut_at_its_position(tmp_path):
    out = tmp_path / "ttft.json"
    assert ttft.main(["--device", "cpu", "--config", str(ROOT / "examples/tiny-k3/config.json"), "--shapes", "1:1",
                      "--layers", "2", "--prefix-len", "128", "--suffix-len", "8", "--new-tokens", "2",
                      "--block-size", "16", "--interval", "64", "--repeats", "1", "--out", str(out)]) == 0
    run = json.loads(out.read_text())["runs"][0]
    assert run["request"]["uncached_cut_at"] == 128 and run["cached_tokens_as_expected"]
    assert set(run["ttft_ms"]) == {"uncached", "cached", "cold_with_cache", "uncached_cut_at_hit"}
    vs_cut = run["cached_vs_uncached_cut"]
    assert vs_cut["of"] == 1 and vs_cut["logits_bitwise_equal"] == 1 and vs_cut["tokens_identical"] == 1
    assert vs_cut["worst_logits_max_abs_diff"] == 0.0
    assert run["speedup_vs_uncached_cut"] > 0 and "uncached_cut_vs_uncached" in run
    # the existing fields stay
    assert {"speedup", "goal_met", "agreement", "repeats", "prefix_cache"} <= set(run)
