"""Plot bench/results/moe_h200.json (written by bench/moe_bench.py on the GPU machine).

    python bench/plot_moe.py [bench/results/moe_h200.json] [bench/results/moe_h200.png]
"""
from __future__ import annotations

import json
import sys

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402


def main(src: str = "bench/results/moe_h200.json", dst: str = "bench/results/moe_h200.png") -> None:
    r = json.load(open(src))
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4))
    pre = r["prefill"]
    bars = {"ours bf16": pre["bf16"]["ours_tflops"], "ours MXFP4": pre["mxfp4"]["ours_tflops"],
            "grouped_mm + SiTU": pre["bf16"]["grouped_mm_unfused_tflops"],
            "grouped_mm GEMMs only": pre["bf16"]["grouped_mm_gemms_tflops"]}
    left.bar(list(bars), list(bars.values()), color=["C0", "C1", "C2", "C3"])
    left.axhline(550, color="k", ls="--", lw=1, label="goal 550")
    left.set_ylabel("TFLOP/s")
    s = r["shape"]
    left.set_title(f"prefill: 4096 tok x top-{s['top_k']}, {s['El']} experts, L {s['L']}, I {s['I']}", fontsize=9)
    left.tick_params(axis="x", labelsize=7, labelrotation=12)
    left.legend(fontsize=8)
    for fmt, color in (("bf16", "C0"), ("mxfp4", "C1")):
        ts = sorted(int(k.split("_T")[1]) for k in r["decode"] if k.startswith(fmt))
        right.plot(ts, [100 * r["decode"][f"{fmt}_T{t}"]["fraction_of_copy_bw"] for t in ts], "o-", color=color,
                   label=f"ours {fmt}")
    right.axhline(80, color="k", ls="--", lw=1, label="goal 80%")
    right.set_xscale("log", base=2)
    right.set_xlabel("tokens")
    right.set_ylabel("% of copy bandwidth (touched expert weights)")
    copy = r.get("decode_copy_bandwidth_GBps", r["copy_bandwidth_GBps"])  # a merged file keeps the decode run's own
    right.set_title(f"decode (copy {copy / 1000:.2f} TB/s same run)", fontsize=9)
    right.legend(fontsize=8)
    fig.suptitle(f"SiTU latent MoE, {r['device']}, {r['date'][:10]}, {r.get('commit', '')[:12]}", fontsize=10)
    fig.tight_layout()
    fig.savefig(dst, dpi=110)


if __name__ == "__main__":
    main(*sys.argv[1:])
