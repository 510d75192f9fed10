"""bench/world2.py (issue 19) on CPU with gloo, at the tiny model's dims: the script the
two-GPU kind runs must split the slice the way it says and measure real collectives, and its
kill check must see the world end."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "bench" / "world2.py"


def _run(tmp_path, *args, timeout=600) -> dict:
    out = tmp_path / "report.json"
    done = subprocess.run([sys.executable, str(SCRIPT), *args, "--device", "cpu", "--out", str(out)],
                          capture_output=True, text=True, timeout=timeout, cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-2000:]
    return json.loads(out.read_text())


def test_slice_split_over_two_ranks_halves_the_rank_and_runs_its_collectives(tmp_path):
    report = _run(tmp_path, "slice", "--config", str(ROOT / "examples" / "tiny-k3" / "config.json"),
                  "--tp", "1", "--ep", "1", "--layers", "4", "--batches", "1,2", "--context", "16",
                  "--iters", "2", "--allreduce-mib", "1")["slice"]
    one, two = report["world1"], report["world2"]
    cfg = json.loads((ROOT / "examples" / "tiny-k3" / "config.json").read_text())
    cfg = cfg.get("text_config", cfg)
    assert one["slice_per_rank"]["local_heads_mla"] == cfg["num_attention_heads"]
    assert two["slice_per_rank"]["local_heads_mla"] == cfg["num_attention_heads"] // 2
    assert two["slice_per_rank"]["local_experts"] == cfg["num_experts"] // 2
    for a, b in zip(one["decode"], two["decode"]):
        assert a["collectives_per_step"] == {}  # world 1 calls no collective
        # the vocab-split LM head gathers once per step; the embedding and every layer's
        # row-parallel ends reduce
        assert b["collectives_per_step"]["all_gather"]["count"] == 1
        assert b["collectives_per_step"]["all_reduce"]["count"] >= 1 + 4
        assert b["collective_ms_per_step"] > 0
    # every collective moves rows of the step's tokens: twice the batch, twice the bytes
    batch1, batch2 = (d["collectives_per_step"] for d in two["decode"])
    for kind in ("all_reduce", "all_gather"):
        assert batch2[kind]["count"] == batch1[kind]["count"]
        assert batch2[kind]["bytes"] == 2 * batch1[kind]["bytes"]
    assert two["allreduce_bandwidth"][0]["bus_GBps"] > 0
    assert [r["batch"] for r in report["world2_over_world1"]] == [1, 2]


def test_killed_rank_ends_the_world_within_seconds(tmp_path):
    kill = _run(tmp_path, "kill", timeout=300)["kill"]
    assert kill["exit_code"] == 1
    assert kill["seconds_to_exit"] < 15
    assert not kill["traceback"] and not kill["processes_left"]
    assert len(kill["error_lines"]) == 1 and "rank 1 was killed by SIGKILL" in kill["error_lines"][0]
