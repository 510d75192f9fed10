"""Where the decode-sized SiTU-MoE op spends its time: device time per kernel (torch.profiler's
CUDA activity records, moe_bench.kernel_ms) for T = 1, 8, 64 tokens, bf16 and MXFP4 experts,
at the bench shape (bench/moe_bench.py: 112 local experts, top-16, latent 3584,
moe_intermediate 3072).

    python3 bench/moe_kernel_breakdown.py --out DIR      (writes DIR/moe_kernel_breakdown.json)

Each kernel's time is the mean over the profiled calls; weight-streaming kernels are also
given as bytes of the touched experts' matrix / time (w13 for gate_up, w2 for down).
"""
from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))
sys.path.insert(0, str(ROOT))

import moe_bench as mb  # noqa: E402

CALLS = 20


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=Path("."))
    args = parser.parse_args()
    g = torch.Generator(device="cuda").manual_seed(0)
    result = {"device": torch.cuda.get_device_name(), "commit": os.environ.get("K3_COMMIT", "unknown"),
              "copy_bandwidth_GBps": mb.copy_bandwidth_gbs(), "cases": {}}
    for mxfp4 in (False, True):
        experts = mb.make_experts(mxfp4, g)
        per_expert = mb.expert_bytes(mxfp4)
        for T in mb.DECODE_T:
            x, z, router, bias = mb.inputs(T, g)
            ids, _ = mb.moe_kernels.route(x, router, bias, mb.TOP_K, 1, 1, 0, True, 1.0)
            touched = int(torch.unique(ids).numel())
            op = torch.ops.k3.situ_moe_mxfp4 if mxfp4 else torch.ops.k3.situ_moe
            times = mb.kernel_ms(lambda: op(x, z, router, bias, *experts, *mb.ATTRS), CALLS)
            gbps = {}
            for name, ms in times.items():
                share = 2 / 3 if name.startswith("gate_up") else 1 / 3 if name.startswith("down") else 0
                if share:
                    gbps[name] = touched * per_expert * share / ms / 1e6
            key = f"{'mxfp4' if mxfp4 else 'bf16'}_T{T}"
            result["cases"][key] = {"touched_experts": touched, "kernel_ms": times,
                                    "total_kernel_ms": sum(times.values()), "weight_stream_GBps": gbps}
            print(key, json.dumps(result["cases"][key]))
        del experts
        torch.cuda.empty_cache()
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "moe_kernel_breakdown.json").write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
