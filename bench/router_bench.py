"""K3's router (896 experts over hidden 7168, fp32 weights, sigmoid top-16) on the GPU at prefill
sizes: the logits kernel's device time and the whole route() call, with the logits' error
against fp64 beside a sequential fp32 sum's. One kernel library per process (K3_KERNELS_LIB);
run it once per library and compare the JSON lines.

    K3_KERNELS_LIB=build/libk3_kernels.so python3 bench/router_bench.py --label base --out DIR

TFLOP/s count the logits' products once (2·T·E·D), not the three bf16 terms each is made of.
Appends one JSON line per run to DIR/router_runs.jsonl.
"""
from __future__ import annotations

import argparse
import datetime
import json
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from k3_trtllm.ops.moe import cuda as moe_kernels  # noqa: E402
from cuda_timing import time_ms  # noqa: E402  (bench/, the script's folder, is on sys.path)
from rank_slice import commit_id  # noqa: E402

E, D, TOP_K = 896, 7168, 16


def kernel_us(fn, calls: int = 5) -> dict[str, float]:
    """Mean device µs per call of each kernel fn launches (torch.profiler)."""
    fn()
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            fn()
        torch.cuda.synchronize()
    out: dict[str, float] = {}
    for evt in prof.key_averages():
        if evt.device_type == torch.autograd.DeviceType.CUDA:
            out[evt.key] = out.get(evt.key, 0.0) + evt.device_time_total / calls
    return out


def logits_errors(x: torch.Tensor, router: torch.Tensor, logits: torch.Tensor) -> dict[str, float]:
    exact = x.double() @ router.double().T
    err = (logits.double() - exact).abs()
    return {"rms_err": float(err.square().mean().sqrt()), "max_err": float(err.max())}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--label", default="")
    ap.add_argument("--tokens", type=int, nargs="+", default=[512, 1024, 2048, 4096, 8192])
    ap.add_argument("--reps", type=int, default=10)
    args = ap.parse_args()
    torch.manual_seed(0)
    g = torch.Generator(device="cuda").manual_seed(0)
    router = torch.randn(E, D, generator=g, device="cuda") * D ** -0.5
    bias = torch.randn(E, generator=g, device="cuda") * 0.1
    rows = []
    for T in args.tokens:
        x = torch.randn(T, D, generator=g, device="cuda").bfloat16()
        logits = torch.empty(T * E, device="cuda")
        call = lambda: moe_kernels.route(x, router, bias, TOP_K, 1, 1, 0, True, 1.0, logits=logits)  # noqa: E731
        graph = torch.cuda.CUDAGraph()
        call()
        torch.cuda.synchronize()
        with torch.cuda.graph(graph):
            call()
        route_ms = time_ms(graph.replay, args.reps, warmup=2)
        kernels = kernel_us(call)
        logits_kernel = {k: v for k, v in kernels.items() if "logits" in k}
        logits_us = sum(logits_kernel.values())
        row = {"tokens": T, "route_ms": route_ms, "logits_us": logits_us,
               "logits_TFLOPs": 2 * T * E * D / (logits_us * 1e-6) / 1e12 if logits_us else None,
               "kernels_us": kernels}
        if T <= 4096:
            call()
            row.update(logits_errors(x, router, logits.view(T, E)))
        rows.append(row)
        print(f"T={T}: route {route_ms:.3f} ms, logits {logits_us:.1f} us "
              f"({row['logits_TFLOPs']:.0f} TFLOP/s) {list(logits_kernel)} "
              f"rms err {row.get('rms_err', float('nan')):.2e}", flush=True)
    run = {"label": args.label, "commit": commit_id(), "gpu": torch.cuda.get_device_name(),
           "torch": torch.__version__, "date_utc": datetime.datetime.now(datetime.timezone.utc).isoformat(),
           "E": E, "D": D, "rows": rows}
    args.out.mkdir(parents=True, exist_ok=True)
    with open(args.out / "router_runs.jsonl", "a") as f:
        f.write(json.dumps(run) + "\n")


if __name__ == "__main__":
    main()
