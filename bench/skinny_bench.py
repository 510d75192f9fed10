#!/usr/bin/env python3
"""One-token projections of one TP8 rank's K3 shapes: the skinny kernel (``ops/linear/cuda.py``)
against torch's ``F.linear`` (cuBLAS), as a decode step runs them: many calls back to back in one
CUDA graph, each on its own weight (a ring of copies larger than L2, so every call streams its
weight from HBM), each call's input made by the call before it (so a call cannot start before
the previous one ends, as in a layer; a launch that overlaps the previous kernel's tail shows).

    K3_KERNELS_LIB=build/libk3_kernels.so python bench/skinny_bench.py --out skinny.json

Reports per shape: us per call for each path, the weight bytes per call at that time (GB/s), and
the ratio torch / skinny (> 1: the skinny kernel is faster)."""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch
from torch.nn import functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from cuda_timing import time_ms  # noqa: E402
from rank_slice import commit_id  # noqa: E402
from k3_trtllm.ops.linear import cuda as skinny  # noqa: E402

# (outputs n, row length k, fp32 output): one TP8/EP8 rank's one-token projections of K3
SHAPES = [(7168, 1536, False), (7168, 3584, False), (6284, 7168, False), (1536, 7168, False),
          (3584, 7168, False), (3648, 7168, False), (2048, 7168, False), (20480, 7168, True)]


def _ring(n: int, k: int, min_bytes: int) -> list[torch.Tensor]:
    count = max(4, -(-min_bytes // (2 * n * k)))
    return [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02 for _ in range(count)]


def _chain(op, x: torch.Tensor, weights: list[torch.Tensor], k: int):
    """One graph of len(weights) calls, each call's input the first k outputs of the call before
    it (tiled if shorter): a dependent chain like a layer's."""
    def step():
        h = x
        for w in weights:
            y = op(h, w)
            # one row: a column slice is contiguous, and so is the repeat's slice made so
            h = y[:, :k] if y.shape[1] >= k else y.repeat(1, -(-k // y.shape[1]))[:, :k].contiguous()
            if h.dtype != torch.bfloat16:
                h = h.to(torch.bfloat16)
        return h
    return step


def measure(n: int, k: int, fp32: bool, reps: int, ring_bytes: int) -> dict:
    weights = _ring(n, k, ring_bytes)
    x = torch.randn(1, k, device="cuda", dtype=torch.bfloat16)
    ops = {"skinny": lambda h, w: skinny.linear(h, w, out_fp32=fp32),
           "torch": (lambda h, w: torch.mm(h, w.t(), out_dtype=torch.float32)) if fp32 else F.linear}
    row = {"n": n, "k": k, "out_fp32": fp32, "calls_per_graph": len(weights)}
    outs = {}
    for name, op in ops.items():
        step = _chain(op, x, weights, k)
        step()
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            outs[name] = step()
        ms = time_ms(graph.replay, reps, warmup=2)
        us = 1e3 * ms / len(weights)
        row[f"{name}_us"] = us
        row[f"{name}_GBps"] = 2 * n * k / (us * 1e3)
    # the two chains agree to bf16 rounding per call (fp32 sums in two orders): a sanity check
    row["chain_max_abs_diff"] = (outs["skinny"].float() - outs["torch"].float()).abs().max().item()
    row["torch_over_skinny"] = row["torch_us"] / row["skinny_us"]
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--reps", type=int, default=20)
    parser.add_argument("--ring-mib", type=int, default=256, help="weight bytes per graph (> L2: 50 MiB)")
    parser.add_argument("--label", default="")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    if not torch.cuda.is_available() or not skinny.available():
        sys.exit("skinny_bench.py: needs a CUDA device and the kernel library (K3_KERNELS_LIB or build/)")
    rows = []
    for n, k, fp32 in SHAPES:
        row = measure(n, k, fp32, args.reps, args.ring_mib << 20)
        rows.append(row)
        print(f"{n:6d} x {k:5d}{' fp32' if fp32 else '     '}: skinny {row['skinny_us']:7.2f} us "
              f"({row['skinny_GBps']:6.0f} GB/s), torch {row['torch_us']:7.2f} us ({row['torch_GBps']:6.0f} GB/s), "
              f"torch/skinny {row['torch_over_skinny']:.3f}", flush=True)
    report = {"label": args.label, "commit": commit_id(), "gpu": torch.cuda.get_device_name(), "torch": torch.__version__,
              "rows": rows}
    if args.out:
        args.out.write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
