#!/usr/bin/env python3
"""The fused AttnRes mix + residual add + RMSNorm (``ops/norm/cuda.py`` attn_res_mix_norm) at one
TP8/EP8 rank's K3 shapes (hidden 7168; 2, 3, 5 and 9 sources; with and without the sub-layer
output added): 16 calls back to back in one CUDA graph, as a decode step runs them (16 mixes per
step), timed per call, for the kernel library that K3_KERNELS_LIB names (one library per process;
compare two runs' files with --compare).

    K3_KERNELS_LIB=build/libk3_kernels.so python bench/norm_bench.py --out base.json
    python bench/norm_bench.py --compare base.json variant.json

Reports per shape: us per call and GB/s of the bytes the call must move (the sources, the
sub-layer output, the partial sum it writes, the normed output, the query and the norm weight)."""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

HIDDEN = 7168
TOKENS = [1, 8, 32, 128, 4096]
SOURCES = [2, 3, 5, 9]
CALLS = 16  # mixes per decode step at the rank slice (8 layers)
EPS = 1e-5


def bytes_moved(tokens: int, n: int, residual: bool, dim: int = HIDDEN) -> int:
    row = tokens * dim * 2
    return row * (n + 1 + (2 if residual else 0)) + dim * 4 + dim * 2


def run(reps: int) -> list[dict]:
    import torch

    from cuda_timing import time_ms
    from k3_trtllm.ops.norm import cuda

    torch.manual_seed(0)
    query = (0.05 * torch.randn(HIDDEN, device="cuda")).float()
    weight = (1 + 0.1 * torch.randn(HIDDEN, device="cuda")).to(torch.bfloat16)
    rows = []
    for tokens in TOKENS:
        pool = [torch.randn(tokens, HIDDEN, device="cuda").to(torch.bfloat16) for _ in range(max(SOURCES) + 1)]
        for n in SOURCES:
            for residual in (False, True):
                sources, res = pool[:n], pool[n] if residual else None
                cuda.attn_res_mix_norm(sources, res, query, EPS, weight, EPS)  # warm up, outside the graph
                torch.cuda.synchronize()
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph):
                    for _ in range(CALLS):
                        cuda.attn_res_mix_norm(sources, res, query, EPS, weight, EPS)
                us = time_ms(graph.replay, reps, warmup=3) * 1e3 / CALLS
                moved = bytes_moved(tokens, n, residual)
                rows.append({"tokens": tokens, "sources": n, "residual": residual, "us": us,
                             "gbps": moved / us * 1e-3})
                print(f"T={tokens:5d} n={n} residual={int(residual)}: {us:8.2f} us/call "
                      f"{moved / us * 1e-3:7.1f} GB/s", flush=True)
                del graph
        del pool
    return rows


def compare(paths: list[str]) -> None:
    runs = [json.loads(Path(p).read_text()) for p in paths]
    names = [r["library"] for r in runs]
    print("T      n res  " + "  ".join(f"{Path(n).parent.name or n:>16}" for n in names) + "   base/each")
    for i, row in enumerate(runs[0]["rows"]):
        us = [r["rows"][i]["us"] for r in runs]
        ratios = "  ".join(f"{us[0] / u:5.2f}x" for u in us[1:])
        print(f"{row['tokens']:5d} {row['sources']:2d} {int(row['residual']):3d}  "
              + "  ".join(f"{u:9.2f} us {r['rows'][i]['gbps']:6.0f}" for u, r in zip(us, runs)) + "   " + ratios)
    for tokens in TOKENS:
        sums = [sum(x["us"] for x in r["rows"] if x["tokens"] == tokens) for r in runs]
        print(f"T={tokens}: sum over the 8 shapes " + ", ".join(f"{s:.1f} us" for s in sums))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", help="JSON file for the results")
    ap.add_argument("--reps", type=int, default=30)
    ap.add_argument("--compare", nargs="+", help="result files to tabulate (the first is the base)")
    args = ap.parse_args()
    if args.compare:
        compare(args.compare)
        return
    import os
    rows = run(args.reps)
    if args.out:
        Path(args.out).write_text(json.dumps({"library": os.environ.get("K3_KERNELS_LIB", ""), "rows": rows}))


if __name__ == "__main__":
    main()
