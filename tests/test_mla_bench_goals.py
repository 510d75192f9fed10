"""bench/mla_bench.py --issue21: every MLA goal of issue 21 is judged from the rows the run
measured, with the right target per shape, and a row the peer did not run is reported as
unmeasured instead of passing or failing."""
from __future__ import annotations

import importlib.util
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
_spec = importlib.util.spec_from_file_location("mla_bench", ROOT / "bench" / "mla_bench.py")
mla_bench = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(mla_bench)


def decode_row(batch, context, heads, ours_us, flashmla_us=None, copy_frac=0.5):
    row = dict(batch=batch, context=context, heads=heads, ours_attn_graph_us=ours_us,
               ours_attn_graph_copy_frac=copy_frac)
    if flashmla_us is not None:
        row["flashmla_attn_graph_us"] = flashmla_us
    return row


def test_goals_take_each_rows_target_and_ratio():
    result = dict(
        decode=[decode_row(64, 8192, 96, 200.0, 250.0),    # 1.25x FlashMLA: the 1.2x goal met
                decode_row(1, 32768, 128, 50.0, 60.0),     # 1.2x: the B=1 goal is 2x, not met
                decode_row(64, 8192, 12, 150.0, 150.0, copy_frac=0.96),
                decode_row(256, 8192, 16, 600.0, copy_frac=0.90),
                decode_row(128, 2048, 128, 100.0)],        # no FlashMLA: unmeasured
        prefill=[dict(tokens=16384, heads=96, ours_vs_sdpa_attn_speed=0.95)],
        fp8=[dict(batch=64, context=8192, heads=12, fp8_vs_bf16_speed=1.1)])
    goals = mla_bench.issue21_goals(result)
    by_shape = {g["goal"]: g for g in goals}
    assert len(goals) == 7
    g = by_shape["decode attention >= 1.2x FlashMLA, B 64 x 8192 x 96 heads"]
    assert g["value"] == 1.25 and g["met"] is True
    g = by_shape["decode attention >= 2.0x FlashMLA, B 1 x 32768 x 128 heads"]
    assert abs(g["value"] - 1.2) < 1e-12 and g["met"] is False
    assert by_shape["decode attention >= 95% of copy, B 64 x 8192 x 12 heads"]["met"] is True
    assert by_shape["decode attention >= 95% of copy, B 256 x 8192 x 16 heads"]["met"] is False
    g = by_shape["decode attention vs FlashMLA, B 128 x 2048 x 128 heads"]
    assert g["value"] is None and g["met"] is None and g["target"] == 1.2
    assert by_shape["prefill >= 0.9x SDPA attention, T 16384 x 96 heads"]["met"] is True
    g = by_shape["fp8 cache attention ~1.8x the bf16 cache's speed, B 64 x 8192 x 12 heads"]
    assert g["target"] == 1.8 and g["met"] is False


def test_issue21_shapes_cover_the_issue_rows():
    """96 and 128 heads at B >= 64, B 1 / 32k / 128 heads, 12 and 16 heads, prefill at 16384,
    fp8 at 8k and 32k: the rows issue 21 names."""
    decode = set(mla_bench.ISSUE21_DECODE)
    assert {(64, 8192, 96), (64, 8192, 128), (1, 32768, 128), (64, 8192, 12), (256, 8192, 16)} <= decode
    assert all(t == 16384 for t, _ in mla_bench.ISSUE21_PREFILL)
    assert {L for _, L, _ in mla_bench.ISSUE21_FP8} == {8192, 32768}
