#!/usr/bin/env python3
"""Plot bench/rank_slice.py's report: decode step time (eager, CUDA graph) beside its memory
floor per batch and context, the share of the floor reached, and prefill's share of the bf16 peak.

    python bench/plot_rank_slice.py bench/results/rank_slice_h200.json bench/results/rank_slice_h200.png
"""
from __future__ import annotations

import json
import sys
from pathlib import Path


def main(argv: list[str]) -> int:
    if len(argv) != 2:
        print("usage: plot_rank_slice.py REPORT.json OUT.png", file=sys.stderr)
        return 2
    try:
        report = json.loads(Path(argv[0]).read_text())
        decode, prefill, sl = report["decode"], report["prefill"], report["slice"]
    except (OSError, json.JSONDecodeError, KeyError) as e:
        print(f"plot_rank_slice.py: {argv[0]}: not a rank_slice report ({e})", file=sys.stderr)
        return 2
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax_t, ax_p, ax_f) = plt.subplots(1, 3, figsize=(17, 5))
    labels = [f"B{r['batch']}\n{r['context'] // 1024}k" for r in decode]
    x = range(len(decode))
    w = 0.27
    ax_t.bar([i - w for i in x], [r["floor_ms"] for r in decode], w, label="memory floor")
    ax_t.bar(x, [r["eager"]["median_ms"] for r in decode], w, label="eager (TorchExecutor)")
    if all("graph" in r for r in decode):
        ax_t.bar([i + w for i in x], [r["graph"]["median_ms"] for r in decode], w, label="CUDA graph (TorchExecutor)")
    ax_t.set_xticks(list(x), labels)
    ax_t.set_ylabel("decode step (ms)")
    ax_t.set_title(f"decode, {sl['layers']} layers at TP{sl['tp']}/EP{sl['ep']} dims")
    ax_t.legend()
    ax_p.plot(list(x), [r["eager_pct_of_floor"] for r in decode], "o-", label="eager")
    if all("graph" in r for r in decode):
        ax_p.plot(list(x), [r["graph_pct_of_floor"] for r in decode], "s-", label="CUDA graph")
    ax_p.axhline(80, color="grey", ls="--", lw=1, label="goal 80%")
    ax_p.set_xticks(list(x), labels)
    ax_p.set_ylim(0, 100)
    ax_p.set_ylabel("% of memory floor")
    ax_p.set_title(f"floor = bytes / {report['copy_bandwidth']['GBps'] / 1e3:.2f} TB/s (copy, same run)")
    ax_p.legend()
    plabels = [f"{r['batch']}x{r['new_tokens_per_seq']}\n@{r['context'] // 1024}k" for r in prefill]
    ax_f.bar(range(len(prefill)), [r["pct_of_peak"] for r in prefill])
    ax_f.axhline(55, color="grey", ls="--", lw=1, label="goal 55%")
    ax_f.set_xticks(range(len(prefill)), plabels, fontsize=8)
    ax_f.set_ylim(0, 100)
    ax_f.set_ylabel("% of bf16 peak")
    ax_f.set_title(f"prefill (seqs x new tokens @ context), peak {report['gemm_peak']['TFLOPs']:.0f} TFLOP/s")
    ax_f.legend()
    fig.suptitle(f"K3 rank slice on {report['meta']['gpu']} (commit {report['meta']['commit'][:10]})")
    fig.tight_layout()
    fig.savefig(argv[1], dpi=110)
    print(f"wrote {argv[1]}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
