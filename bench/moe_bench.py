"""SiTU latent-MoE routed part on the GPU: ours (plugins/c_api/moe.cu) next to torch._grouped_mm.

    python3 bench/moe_bench.py --out DIR        (writes DIR/moe_h200.json)
    python3 bench/moe_bench.py --prefill-only --out DIR
    python3 bench/moe_bench.py --ours-only --out DIR  (no torch baselines: library A/B runs)
    python3 bench/moe_bench.py --decode-only --label NAME --out DIR [--kinds mxfp4]
        (decode cases alone, with per-kernel times; writes DIR/moe_decode_h200.json and appends
        one line per run to DIR/decode_runs.jsonl, so several kernel libraries run one after
        another in one device call land side by side)
    python3 bench/moe_bench.py --profile-once   (one eager bf16 prefill call, for ncu)
    python3 bench/moe_bench.py --prefill-only --ep8-prefill --kinds mxfp4 --ours-only --out DIR
        (adds the prefill as one EP8 rank sees it: router over 896 experts, 112 local, ~74 rows each on average)

Prefill: 4096 tokens x top-16 over 112 local experts (E = El = 112: one EP rank's share after
the all-to-all), latent 3584, moe_intermediate 3072, router input 7168. TFLOP/s count the two
expert GEMMs only (2·rows·L·2I + 2·rows·I·L, rows = 4096·16) for every column, so the columns
compare directly: ours = the whole op (router, permutation, gate/up GEMM + fused GLU, down GEMM +
weighted fp32 combine, rounding); grouped_mm_unfused = gather, torch._grouped_mm(w13), SiTU in
fp32 torch ops, torch._grouped_mm(w2), weighted index_add (routing precomputed, not timed);
grouped_mm_gemms = the two torch._grouped_mm calls alone.
Decode (T = 1, 8, 64, same experts): time of the whole op vs the time to read the touched
experts' weights once at the copy bandwidth measured in this run (copy bandwidth = bytes read +
written by a 4 GiB device-to-device copy / its time); bf16 and MXFP4 (W4A16) experts. Each case
also lists its kernels' device times (torch.profiler, eager calls) and, for the two expert GEMVs,
the touched bytes of their matrix (w13: 2/3 of an expert, w2: 1/3) over that time. --ep-rank adds
decode as one EP8 rank sees it (T = 1, 8, 32, 128; router over 896 experts, these 112 one rank's
shard; 128 is the rank slice's batch-128 shape): only the local experts that got a token count
(1-3 at T = 1). The later
kernels of the decode chain are programmatic dependents (pdl.cuh), so their profiled times
include a few µs of waiting for the kernel before; the graph time is the op's.
Times: CUDA events, median of a few repetitions after one warm-up (weights are far larger than
L2, so decode reads come from HBM). Prefill also lists each kernel's device time (torch.profiler,
mean over a few calls) under kernel_ms.
"""
from __future__ import annotations

import argparse
import collections
import datetime
import json
import os
import sys
import traceback
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from k3_trtllm.ops.moe import cuda as moe_kernels  # noqa: E402
from k3_trtllm.ops.common import situ_glu  # noqa: E402
from cuda_timing import time_ms  # noqa: E402  (bench/, the script's folder, is on sys.path)

E = EL = 112
TOP_K, L, I, D = 16, 3584, 3072, 7168
PREFILL_T = 4096
DECODE_T = (1, 8, 64)
EP_E, EP_DECODE_T = 896, (1, 8, 32, 128)  # --ep-rank: K3's router, these EL experts one EP8 rank's shard
BETA, LINEAR_BETA = 2.0, 4.0
ATTRS = (E, TOP_K, 1, 1, 0, 0, 1, 1.0, 1, BETA, LINEAR_BETA)


def copy_bandwidth_gbs() -> float:
    src = torch.empty(4 << 30, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    ms = time_ms(lambda: dst.copy_(src), 5)
    return 2 * (4 << 30) / ms / 1e6


def make_experts(mxfp4: bool, g: torch.Generator):
    if not mxfp4:
        w13 = (torch.randn(EL, 2 * I, L, generator=g, device="cuda") * L ** -0.5).bfloat16()
        w2 = (torch.randn(EL, L, I, generator=g, device="cuda") * I ** -0.5).bfloat16()
        return [w13, w2]
    out = []
    for rows, cols in ((2 * I, L), (L, I)):
        out.append(torch.randint(0, 256, (EL, rows, cols // 2), generator=g, device="cuda", dtype=torch.uint8))
        out.append(torch.randint(119, 123, (EL, rows, cols // 32), generator=g, device="cuda", dtype=torch.uint8))
    return out


def expert_bytes(mxfp4: bool) -> int:
    elems = 3 * I * L  # w13 (2I x L) + w2 (L x I)
    return elems // 2 + elems // 32 if mxfp4 else 2 * elems


def inputs(T: int, g: torch.Generator, num_experts: int = E):
    x = torch.randn(T, D, generator=g, device="cuda").bfloat16()
    z = torch.randn(T, L, generator=g, device="cuda").bfloat16()
    router = torch.randn(num_experts, D, generator=g, device="cuda") * D ** -0.5
    bias = torch.randn(num_experts, generator=g, device="cuda") * 0.1
    return x, z, router, bias


def grouped_mm_baselines(x, z, router, bias, w13, w2) -> dict:
    """torch._grouped_mm at the same shape: unfused (gather, GEMM, SiTU, GEMM, combine) and GEMMs alone."""
    ids, weights = moe_kernels.route(x, router, bias, TOP_K, 1, 1, 0, True, 1.0)
    flat = ids.flatten().long()
    order = flat.argsort()
    tokens = order // TOP_K
    counts = torch.bincount(flat, minlength=EL)
    offs = counts.cumsum(0).to(torch.int32)
    w_sorted = weights.flatten()[order]
    w13_t, w2_t = w13.transpose(1, 2), w2.transpose(1, 2)  # [El, L, 2I], [El, I, L]
    a = z[tokens]
    h = torch.zeros(a.shape[0], I, dtype=torch.bfloat16, device="cuda")

    def gemms():
        torch._grouped_mm(a, w13_t, offs=offs)
        return torch._grouped_mm(h, w2_t, offs=offs)

    def unfused():
        gu = torch._grouped_mm(z[tokens], w13_t, offs=offs)
        h.copy_(situ_glu(gu[:, :I], gu[:, I:], BETA, LINEAR_BETA))
        y = torch._grouped_mm(h, w2_t, offs=offs)
        out = torch.zeros(z.shape, dtype=torch.float32, device="cuda")
        out.index_add_(0, tokens, y.float() * w_sorted[:, None])
        return out.bfloat16()

    return {"grouped_mm_unfused_ms": time_ms(unfused, 3), "grouped_mm_gemms_ms": time_ms(gemms, 3)}


def kernel_ms(fn, calls: int = 3) -> dict[str, float]:
    """Device time per kernel (template arguments kept: they tell the GEMMs apart), mean per call."""
    from torch.profiler import ProfilerActivity, profile
    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            fn()
        torch.cuda.synchronize()
    totals: dict[str, float] = collections.defaultdict(float)
    for event in prof.events():
        if event.device_type == torch.autograd.DeviceType.CUDA:
            name = event.name.split("(")[0].replace("void ", "").replace("k3::moe::", "")
            totals[name] += event.device_time_total / 1e3 / calls
    return dict(sorted(totals.items(), key=lambda kv: -kv[1]))


def run_op(mxfp4: bool, x, z, router, bias, experts, attrs=ATTRS):
    """The op as a CUDA graph replay, so decode times are the GPU's, not Python's launch
    overhead (eager if capture fails; recorded in the JSON)."""
    op = torch.ops.k3.situ_moe_mxfp4 if mxfp4 else torch.ops.k3.situ_moe
    eager = lambda: op(x, z, router, bias, *experts, *attrs)  # noqa: E731
    try:
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            eager()
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            eager()
        return graph.replay, "cuda_graph"
    except RuntimeError:
        traceback.print_exc()
        return eager, "eager"


def prefill_case(mxfp4: bool, experts, g: torch.Generator, ours_only: bool, ep_rank: bool = False) -> dict:
    """ep_rank: prefill as one EP8 rank sees it (the rank-slice shape): K3's router over EP_E
    experts, these EL experts (0..EL-1) the rank's shard, so ~T·k/8 rows (~74 per expert on
    average; this random router is skewed: 0-1014 rows per expert in the H200 run); TFLOP/s count
    the local rows only (local_rows in the entry)."""
    num_experts = EP_E if ep_rank else E
    x, z, router, bias = inputs(PREFILL_T, g, num_experts)
    attrs = (num_experts, *ATTRS[1:])
    fn, mode = run_op(mxfp4, x, z, router, bias, experts, attrs)
    op = torch.ops.k3.situ_moe_mxfp4 if mxfp4 else torch.ops.k3.situ_moe
    entry = {"ours_ms": time_ms(fn, 3), "ours_timing": mode,
             "ours_router_ms": time_ms(lambda: moe_kernels.route(x, router, bias, TOP_K, 1, 1, 0, True, 1.0), 3),
             "kernel_ms": kernel_ms(lambda: op(x, z, router, bias, *experts, *attrs))}
    rows = PREFILL_T * TOP_K
    if ep_rank:
        ids, _ = moe_kernels.route(x, router, bias, TOP_K, 1, 1, 0, True, 1.0)
        counts = torch.bincount(ids.flatten().long(), minlength=num_experts)[:EL]
        rows = int(counts.sum())
        entry.update({"num_experts": num_experts, "local_rows": rows, "rows_per_expert_min_max":
                      [int(counts.min()), int(counts.max())]})
    if not mxfp4 and not ours_only and not ep_rank:
        # K3's whole router (896 experts, before the all-to-all) at the same T, for scale.
        router896 = torch.randn(8 * E, D, generator=g, device="cuda") * D ** -0.5
        bias896 = torch.randn(8 * E, generator=g, device="cuda") * 0.1
        entry["router_e896_ms"] = time_ms(
            lambda: moe_kernels.route(x, router896, bias896, TOP_K, 1, 1, 0, True, 1.0), 3)
        try:
            entry.update(grouped_mm_baselines(x, z, router, bias, *experts))
        except Exception as exc:  # a missing / different torch._grouped_mm must not lose the rest
            entry["grouped_mm_error"] = "".join(traceback.format_exception_only(exc)).strip()
    flops = 2 * rows * (L * 2 * I + I * L)
    for key in [k for k in entry if k.endswith("_ms") and "router" not in k and k != "kernel_ms"]:
        entry[key.replace("_ms", "_tflops")] = flops / entry[key] / 1e9
    return entry


def time_l2_flushed_ms(fn, reps: int) -> float:
    """``time_ms`` with a buffer four times the size of L2 overwritten before each timed call, so the
    few experts a decode touches are read from HBM as in a real step, not from L2."""
    l2_bytes = getattr(torch.cuda.get_device_properties(0), "L2_cache_size", 50 << 20)  # H200: 50 MB
    flush = torch.empty(4 * l2_bytes, dtype=torch.uint8, device="cuda")
    return time_ms(fn, reps, before=lambda: flush.fill_(1))


def decode_case(mxfp4: bool, T: int, experts, g: torch.Generator, copy_gbps: float, ep_rank: bool = False) -> dict:
    """ep_rank: K3's whole router (EP_E experts) with these EL experts as one EP8 rank's shard,
    the one holding token 0's best expert (as a rank sees decode: 1-3 local experts per token
    at T = 1); else all E = EL experts local."""
    num_experts = EP_E if ep_rank else E
    x, z, router, bias = inputs(T, g, num_experts)
    ids, _ = moe_kernels.route(x, router, bias, TOP_K, 1, 1, 0, True, 1.0)
    offset = int(ids[0, 0]) // EL * EL if ep_rank else 0
    attrs = (num_experts, *ATTRS[1:4], offset, *ATTRS[5:])
    local = ids.flatten() - offset
    touched = int(torch.unique(local[(local >= 0) & (local < EL)]).numel())
    fn, mode = run_op(mxfp4, x, z, router, bias, experts, attrs)
    # The 1-3 experts an EP rank touches at T = 1 (17.5 MB each in MXFP4) would stay in the 50 MB
    # L2 across repetitions; in the model every layer has other experts, so flush L2 there.
    ms = time_l2_flushed_ms(fn, 20) if ep_rank else time_ms(fn, 20)
    read_ms = touched * expert_bytes(mxfp4) / (copy_gbps * 1e6)
    route = lambda: moe_kernels.route(x, router, bias, TOP_K, 1, 1, 0, True, 1.0)  # noqa: E731
    op = torch.ops.k3.situ_moe_mxfp4 if mxfp4 else torch.ops.k3.situ_moe
    kernels = kernel_ms(lambda: op(x, z, router, bias, *experts, *attrs), 10)
    gemv_gbps = {}
    for kernel, kms in kernels.items():
        share = 2 / 3 if kernel.startswith("gate_up") else 1 / 3 if kernel.startswith("down") else 0
        if share:
            gemv_gbps[kernel] = touched * expert_bytes(mxfp4) * share / kms / 1e6
    return {"ours_ms": ms, "ours_timing": mode, "touched_experts": touched,
            "ours_router_ms_eager": time_ms(route, 10), "weight_read_ms_at_copy_bw": read_ms,
            "fraction_of_copy_bw": read_ms / ms, "kernel_ms": kernels, "gemv_weight_GBps": gemv_gbps}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=Path("."))
    parser.add_argument("--prefill-only", action="store_true", help="skip the decode cases")
    parser.add_argument("--decode-only", action="store_true", help="skip the prefill cases")
    parser.add_argument("--label", default="", help="name of this run's kernel library in the JSON")
    parser.add_argument("--ours-only", action="store_true",
                        help="skip the torch._grouped_mm baselines and the 896-expert router (A/B runs of "
                             "two kernel libraries need only our op)")
    parser.add_argument("--batch-invariant", action="store_true",
                        help="the MoE batch-invariant mode (kernels chosen by sizes, not token count)")
    parser.add_argument("--kinds", nargs="+", choices=("bf16", "mxfp4"), default=["bf16", "mxfp4"],
                        help="expert formats to run (an A/B of MXFP4 kernels with identical bf16 ones: mxfp4)")
    parser.add_argument("--ep-rank", action="store_true",
                        help=f"also decode as one EP8 rank (router over {EP_E} experts, T = {EP_DECODE_T}): "
                             "few local experts touched")
    parser.add_argument("--ep8-prefill", action="store_true",
                        help=f"also prefill as one EP8 rank (router over {EP_E} experts, {EL} local: the rank-slice shape)")
    parser.add_argument("--profile-once", action="store_true",
                        help="only call the bf16 prefill op once, eagerly (run under ncu)")
    args = parser.parse_args()
    g = torch.Generator(device="cuda").manual_seed(0)
    if args.batch_invariant:
        moe_kernels.set_batch_invariant(True)
    if args.profile_once:
        torch.ops.k3.situ_moe(*inputs(PREFILL_T, g), *make_experts(False, g), *ATTRS)
        torch.cuda.synchronize()
        return
    result = {"device": torch.cuda.get_device_name(), "torch": torch.__version__,
              "commit": os.environ.get("K3_COMMIT", "unknown"), "batch_invariant": args.batch_invariant,
              "label": args.label, "kernels_lib": os.environ.get("K3_KERNELS_LIB", "build/libk3_kernels.so"),
              "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
              "shape": {"E": E, "El": EL, "top_k": TOP_K, "L": L, "I": I, "D": D},
              "copy_bandwidth_GBps": copy_bandwidth_gbs(), "prefill": {}, "decode": {}}
    print(f"copy bandwidth {result['copy_bandwidth_GBps']:.0f} GB/s")
    for name in args.kinds:
        mxfp4 = name == "mxfp4"
        experts = make_experts(mxfp4, g)
        if not args.decode_only:
            result["prefill"][name] = prefill_case(mxfp4, experts, g, args.ours_only)
            print(name, "prefill", json.dumps(result["prefill"][name]))
            if args.ep8_prefill:
                result["prefill"][f"{name}_ep8"] = prefill_case(mxfp4, experts, g, args.ours_only, ep_rank=True)
                print(name, "prefill EP8 rank", json.dumps(result["prefill"][f"{name}_ep8"]))
        for T in () if args.prefill_only else DECODE_T:
            result["decode"][f"{name}_T{T}"] = decode_case(mxfp4, T, experts, g, result["copy_bandwidth_GBps"])
            print(name, f"decode T={T}", json.dumps(result["decode"][f"{name}_T{T}"]))
        for T in EP_DECODE_T if args.ep_rank and not args.prefill_only else ():
            key = f"{name}_ep8_T{T}"
            result["decode"][key] = decode_case(mxfp4, T, experts, g, result["copy_bandwidth_GBps"], ep_rank=True)
            print(name, f"decode EP8 rank T={T}", json.dumps(result["decode"][key]))
        del experts
        torch.cuda.empty_cache()
    args.out.mkdir(parents=True, exist_ok=True)
    if args.decode_only:
        (args.out / "moe_decode_h200.json").write_text(json.dumps(result, indent=2) + "\n")
        with open(args.out / "decode_runs.jsonl", "a") as runs:
            runs.write(json.dumps(result) + "\n")
    else:
        (args.out / "moe_h200.json").write_text(json.dumps(result, indent=2) + "\n")
    if result["decode"]:
        print(f"{'case':<12} {'op ms':>8} {'floor ms':>8} {'of floor':>8} {'gate_up GB/s':>12} {'down GB/s':>10}  {args.label}")
        for key, d in result["decode"].items():
            bw = {k.split("_decode")[0]: v for k, v in d["gemv_weight_GBps"].items()}
            print(f"{key:<12} {d['ours_ms']:8.3f} {d['weight_read_ms_at_copy_bw']:8.3f} {d['fraction_of_copy_bw']:8.1%} "
                  f"{bw.get('gate_up', 0):12.0f} {bw.get('down', 0):10.0f}")


if __name__ == "__main__":
    main()
