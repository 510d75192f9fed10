"""KDA prefill / decode on the GPU: ours (plugins/c_api/kda.cu) next to FlashKDA and FLA.

Run on the GPU machine, in one process, so that every number shares the card's state:
    python3 bench/kda_bench.py --out DIR [--decode-only | --prefill-only] [--shapes T4096_H96 ...]
                               [--decode-batches 1 64 256] [--no-fla] [--deadline-s 100] [--rep-ms 300]
    python3 bench/kda_bench.py --plot RESULTS.json PNG      (re-plot a results file, no GPU)
Peers, if importable: FlashKDA = ``_flashkda_C.abi3.so`` from the vllm==0.33.0 wheel
(path in --flashkda), FLA = ``fla-core==0.6.0`` (chunk_kda / fused_recurrent_kda).
Our kernels are timed through their C launchers (no torch-side argument checks), the peers
through their Python entry points. Ours includes the short conv + SiLU (raw qkv in);
FlashKDA and FLA start from post-conv q, k, v (vLLM runs the conv as a separate kernel),
so their numbers leave that pass out. Times: triton.testing.do_bench medians (events,
L2 flushed between runs). Every prefill shape is also checked: our chunked prefill against
our token-recurrent decode kernel on the same inputs (relative Frobenius error of the output
and the final state). Writes DIR/kda_h200.json (after every row, so a run cut short keeps what it
measured) and DIR/kda_h200.png. FLA goes last, every row, while --deadline-s (seconds from the
start) leaves time: its Triton autotuning takes tens of seconds, ours and FlashKDA's none.
"""
from __future__ import annotations

import argparse
import ctypes
import datetime
import hashlib
import json
import os
import subprocess
import sys
import time
import traceback
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from k3_trtllm.ops import cuda_library as kernels  # noqa: E402
from k3_trtllm.ops.c_abi import KDA  # noqa: E402
from k3_trtllm.ops.kda import cuda as kda_kernels  # noqa: E402

D, W, LB = 128, 4, -5.0
PREFILL_SHAPES = [  # name, sequence lengths, heads
    ("T4096_H96", [4096], 96),
    ("T16384_H96", [16384], 96),
    ("varlen64x256_H96", [256] * 64, 96),
    ("T16384_H12", [16384], 12),
    ("varlen16x1024_H12", [1024] * 16, 12),
]
DECODE_BATCHES = [1, 64, 256]
DECODE_HEADS = 96


TIMING = {"rep_ms": 300}  # do_bench's measuring time per number (--rep-ms)


def median_ms(fn) -> float:
    import triton.testing  # GPU machine only; --plot runs without it
    fn()
    torch.cuda.synchronize()
    rep = TIMING["rep_ms"]
    return float(triton.testing.do_bench(fn, warmup=min(50, rep), rep=rep, return_mode="median"))


def source_hash() -> str:
    files = sorted((ROOT / "plugins/include/k3/kda").glob("*.cuh")) + [
        ROOT / "plugins/c_api/kda.cu", ROOT / "k3_trtllm/ops/kda/cuda.py", Path(__file__)]
    h = hashlib.sha256()
    for f in files:
        h.update(f.read_bytes())
    return h.hexdigest()[:16]


def commit_id() -> str:
    if os.environ.get("K3_COMMIT"):
        return os.environ["K3_COMMIT"]
    try:
        return subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True,
                              check=True).stdout.strip()
    except (subprocess.CalledProcessError, OSError):
        return "uncommitted"


def inputs(lengths, H):
    """Raw contract inputs (random, not zeros) for one varlen batch with initial states."""
    T, B, P = sum(lengths), len(lengths), H * D
    dev = "cuda"
    cu = torch.tensor([0] + list(torch.tensor(lengths).cumsum(0)), dtype=torch.int32, device=dev)
    return dict(
        qkv=torch.randn(T, 3 * P, device=dev).bfloat16(),
        gate=(torch.randn(T, P, device=dev) * 2).bfloat16(),
        beta=(torch.randn(T, H, device=dev) * 2).bfloat16(),
        conv_weight=torch.randn(3 * P, W, device=dev) * 0.6,
        A_log=torch.randn(H, device=dev) * 0.5,
        dt_bias=torch.randn(P, device=dev) * 0.5,
        cu_seqlens=cu,
        state_slots=torch.arange(B, dtype=torch.int32, device=dev),
        has_initial_state=torch.ones(B, dtype=torch.int32, device=dev),
        conv_state=torch.randn(B, 3 * P, W - 1, device=dev).bfloat16(),
        recurrent_state=torch.randn(B, H, D, D, device=dev) * 0.3,
        # prefix-cache snapshots (issue 22): none taken (every offset -1, one unused row)
        snapshot_offsets=torch.full((B, 1), -1, dtype=torch.int32, device=dev),
        snapshot_rows=torch.zeros(B, 1, dtype=torch.int32, device=dev),
        snapshot_conv=torch.zeros(1, 3 * P, W - 1, device=dev, dtype=torch.bfloat16),
        snapshot_recurrent=torch.zeros(1, H, D, D, device=dev),
        out=torch.empty(T, P, device=dev, dtype=torch.bfloat16),
        H=H, B=B, T=T,
    )


def ours(name: str, x, lib=None):
    lib = lib or kda_kernels._library()
    fn = getattr(lib, name)
    nbytes = lib.k3_kda_prefill_workspace_bytes(x["T"], x["B"], x["H"], D, LB) if name == "k3_kda_prefill" else 0
    work = torch.empty(max(nbytes, 16), dtype=torch.uint8, device="cuda")
    params = ctypes.byref(KDA.fill([x[k] for k in STATE_KEYS], (x["out"],), (x["H"], D, LB), work))
    stream = torch.cuda.current_stream().cuda_stream

    def run():
        status = fn(params, stream)
        if status != 0:
            raise RuntimeError(f"{name} returned CUDA error {status}")
    return run


# the contract's inputs in order (inputs() makes every one the contract names)
STATE_KEYS = tuple(spec.name for spec in KDA.contract.inputs)


def decode_errors(x) -> dict[str, float]:
    """One decode call of ours on copies of the inputs against the fp32 reference op on the CPU
    (relative Frobenius errors of out and state; the conv state must match exactly). At the
    bench's batch sizes every persistent CTA walks many items, which the unit tests do not."""
    import k3_trtllm.ops.kda  # noqa: F401  (registers the reference ops)
    cpu = {k: x[k].cpu() for k in STATE_KEYS}
    ref_out = torch.ops.k3.kda_decode(*(cpu[k] for k in STATE_KEYS), x["H"], D, LB)
    mine = dict(x, conv_state=x["conv_state"].clone(), recurrent_state=x["recurrent_state"].clone(),
                out=torch.empty_like(x["out"]))
    ours("k3_kda_decode", mine)()
    torch.cuda.synchronize()

    def rel(a, b):
        a, b = a.double().cpu(), b.double()
        return float((a - b).norm() / b.norm())
    return dict(out=rel(mine["out"], ref_out), state=rel(mine["recurrent_state"], cpu["recurrent_state"]),
                conv_state_exact=bool(torch.equal(mine["conv_state"].cpu(), cpu["conv_state"])))


def prefill_vs_recurrence(x) -> dict[str, float]:
    """Our chunked prefill against our token-recurrent kernel (fp32 throughout) on copies of
    the same inputs: relative Frobenius errors of the output and the final state."""
    runs = {}
    for name in ("k3_kda_prefill", "k3_kda_decode"):
        mine = dict(x, conv_state=x["conv_state"].clone(), recurrent_state=x["recurrent_state"].clone(),
                    out=torch.full_like(x["out"], float("nan")))
        ours(name, mine)()
        runs[name] = mine
    torch.cuda.synchronize()

    def rel(a, b):
        a, b = a.double(), b.double()
        return float((a - b).norm() / b.norm())
    p, d = runs["k3_kda_prefill"], runs["k3_kda_decode"]
    return dict(out=rel(p["out"], d["out"]), state=rel(p["recurrent_state"], d["recurrent_state"]))


def kernel_breakdown(x, lib=None) -> dict[str, float]:
    """Device time per kernel of one prefill call (torch profiler), in ms."""
    from torch.profiler import ProfilerActivity, profile
    run = ours("k3_kda_prefill", x, lib)
    run()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        run()
        torch.cuda.synchronize()
    times: dict[str, float] = {}
    for ev in prof.events():
        if ev.device_type == torch.autograd.DeviceType.CUDA:
            name = ev.name.split("<")[0].split("(")[0].replace("void ", "").split("::")[-1]
            times[name] = times.get(name, 0.0) + ev.device_time / 1e3
    return times


def peer_tensors(x):
    """Post-conv q, k, v (what FlashKDA / FLA take), raw gate and beta, [1, T, H, D]."""
    T, H = x["T"], x["H"]
    q, k, v = (torch.randn(1, T, H, D, device="cuda").bfloat16() for _ in range(3))
    g = x["gate"].view(1, T, H, D)
    beta = x["beta"].view(1, T, H)
    return q, k, v, g, beta


def flashkda(x):
    T, H, B = x["T"], x["H"], x["B"]
    q, k, v, g, beta = peer_tensors(x)
    out = torch.empty_like(q)
    ws = torch.empty(torch.ops._flashkda_C.get_workspace_size(T, H, B), dtype=torch.uint8, device="cuda")
    h0 = torch.randn(B, H, D, D, device="cuda") * 0.3
    ht = torch.empty_like(h0)
    dt_bias = x["dt_bias"].view(H, D)

    def run():
        torch.ops._flashkda_C.fwd(q, k, v, g, beta, D ** -0.5, out, ws, x["A_log"], dt_bias, LB,
                                  h0, ht, x["cu_seqlens"], None, None)
    return run


def fla_chunk(x):
    from fla.ops.kda import chunk_kda
    q, k, v, g, beta = peer_tensors(x)
    h0 = torch.randn(x["B"], x["H"], D, D, device="cuda") * 0.3
    cu = x["cu_seqlens"].long()
    cu_cpu = cu.cpu()

    def run():
        chunk_kda(q, k, v, g, beta, scale=D ** -0.5, initial_state=h0, output_final_state=True,
                  use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True,
                  use_beta_sigmoid_in_kernel=True, safe_gate=True, lower_bound=LB,
                  A_log=x["A_log"], dt_bias=x["dt_bias"], cu_seqlens=cu, cu_seqlens_cpu=cu_cpu)
    return run


def fla_recurrent(x):
    from fla.ops.kda import fused_recurrent_kda
    q, k, v, g, beta = peer_tensors(x)
    h0 = x["recurrent_state"]
    cu = x["cu_seqlens"].long()

    def run():
        fused_recurrent_kda(q, k, v, g, beta, A_log=x["A_log"], dt_bias=x["dt_bias"],
                            scale=D ** -0.5, initial_state=h0, output_final_state=True,
                            use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True,
                            use_beta_sigmoid_in_kernel=True, lower_bound=LB, cu_seqlens=cu)
    return run


def timed(label, make, x, errors):
    try:
        return median_ms(make(x))
    except Exception as exc:  # a peer that fails to load or run is recorded, not fatal
        errors[label] = f"{type(exc).__name__}: {exc}"
        traceback.print_exc()
        return None


def copy_bandwidth_tbs() -> float:
    n = 4 << 30
    src = torch.empty(n, dtype=torch.uint8, device="cuda").random_()
    dst = torch.empty_like(src)
    ms = median_ms(lambda: dst.copy_(src))
    del src, dst
    return 2 * n / ms / 1e9


def ratio(a, b):
    return None if a is None or b is None else b / a


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", type=Path)
    ap.add_argument("--flashkda", type=Path, default=ROOT / ".carry/_flashkda_C.abi3.so")
    ap.add_argument("--no-fla", action="store_true", help="skip FLA (its Triton autotuning is slow)")
    ap.add_argument("--decode-only", action="store_true", help="skip the prefill shapes")
    ap.add_argument("--prefill-only", action="store_true", help="skip the decode batches")
    ap.add_argument("--shapes", nargs="+", default=[s[0] for s in PREFILL_SHAPES],
                    help="prefill shapes to run (names as in PREFILL_SHAPES)")
    ap.add_argument("--plot", nargs=2, type=Path, metavar=("JSON", "PNG"),
                    help="only draw the plot of a results file")
    ap.add_argument("--decode-batches", type=int, nargs="+", default=DECODE_BATCHES,
                    help="decode batch sizes (96 heads, one token per sequence)")
    ap.add_argument("--deadline-s", type=float, default=None,
                    help="seconds from the start after which no FLA number is started (they go last)")
    ap.add_argument("--rep-ms", type=int, default=TIMING["rep_ms"], help="do_bench measuring time per number")
    args = ap.parse_args()
    if args.plot:
        plot(json.loads(args.plot[0].read_text()), args.plot[1])
        return
    start = time.monotonic()
    TIMING["rep_ms"] = args.rep_ms
    args.out.mkdir(parents=True, exist_ok=True)
    errors: dict[str, str] = {}
    try:
        torch.ops.load_library(str(args.flashkda))
    except Exception as exc:
        errors["flashkda_load"] = f"{type(exc).__name__}: {exc}"

    torch.manual_seed(0)
    copy = copy_bandwidth_tbs()
    result = dict(
        gpu=torch.cuda.get_device_name(), date=datetime.datetime.now(datetime.timezone.utc).isoformat(),
        commit=commit_id(), source_sha256_16=source_hash(), torch=torch.__version__,
        kernels_lib=str(kernels.library_path()),
        head_dim=D, conv_width=W, lower_bound=LB, copy_bandwidth_TBps=copy, rep_ms=args.rep_ms,
        note="ours includes the short conv + SiLU; FlashKDA and FLA start from post-conv q/k/v",
        prefill=[], decode=[], errors=errors,
    )

    def save():
        (args.out / "kda_h200.json").write_text(json.dumps(result, indent=2))

    shapes = [s for s in PREFILL_SHAPES if s[0] in args.shapes]
    for name, lengths, H in ([] if args.decode_only else shapes):
        x = inputs(lengths, H)
        ms = {"ours": timed(f"ours/{name}", lambda x: ours("k3_kda_prefill", x), x, errors),
              "flashkda": timed(f"flashkda/{name}", flashkda, x, errors), "fla": None}
        try:
            breakdown = kernel_breakdown(x)
        except Exception as exc:
            breakdown = None
            errors[f"profile/{name}"] = f"{type(exc).__name__}: {exc}"
        try:
            check = prefill_vs_recurrence(x)
        except Exception as exc:
            check = None
            errors[f"check/{name}"] = f"{type(exc).__name__}: {exc}"
        row = dict(shape=name, tokens=x["T"], heads=H, seqs=x["B"], ms=ms, ours_kernels_ms=breakdown,
                   rel_err_vs_recurrent_kernel=check,
                   Mtok_per_s={k: (None if v is None else x["T"] / v / 1e3) for k, v in ms.items()},
                   speedup_vs_flashkda=ratio(ms["ours"], ms["flashkda"]), speedup_vs_fla=None)
        result["prefill"].append(row)
        print(json.dumps(row), flush=True)
        save()
        del x
        torch.cuda.empty_cache()
    state_bytes = {}
    for B in ([] if args.prefill_only else args.decode_batches):
        x = inputs([1] * B, DECODE_HEADS)
        state_bytes[B] = 2 * B * DECODE_HEADS * D * D * 4  # fp32 state read + written
        ms = {"ours": timed(f"ours/decode{B}", lambda x: ours("k3_kda_decode", x), x, errors), "fla": None}
        tbs = {k: (None if v is None else state_bytes[B] / v / 1e9) for k, v in ms.items()}
        try:
            errs = decode_errors(inputs([1] * B, DECODE_HEADS))
        except Exception as exc:
            errs = None
            errors[f"check/decode{B}"] = f"{type(exc).__name__}: {exc}"
        row = dict(batch=B, heads=DECODE_HEADS, ms=ms, state_TBps=tbs, rel_err_vs_reference=errs,
                   fraction_of_copy={k: (None if v is None else v / copy) for k, v in tbs.items()},
                   speedup_vs_fla=None)
        result["decode"].append(row)
        print(json.dumps(row), flush=True)
        save()
        del x
        torch.cuda.empty_cache()

    # FLA last: a row it has no time for keeps ours and FlashKDA's numbers and says why in errors
    def fla_time_left(label):
        if args.deadline_s is None or time.monotonic() - start < args.deadline_s:
            return True
        errors[label] = f"skipped: past --deadline-s {args.deadline_s:g}"
        return False
    for row, (name, lengths, H) in zip(result["prefill"], shapes):
        if args.no_fla or not fla_time_left(f"fla/{name}"):
            continue
        x = inputs(lengths, H)
        row["ms"]["fla"] = timed(f"fla/{name}", fla_chunk, x, errors)
        row["Mtok_per_s"]["fla"] = None if row["ms"]["fla"] is None else x["T"] / row["ms"]["fla"] / 1e3
        row["speedup_vs_fla"] = ratio(row["ms"]["ours"], row["ms"]["fla"])
        save()
        del x
        torch.cuda.empty_cache()
    for row in result["decode"]:
        B = row["batch"]
        if args.no_fla or not fla_time_left(f"fla/decode{B}"):
            continue
        row["ms"]["fla"] = timed(f"fla/decode{B}", fla_recurrent, inputs([1] * B, DECODE_HEADS), errors)
        fla = row["ms"]["fla"]
        row["state_TBps"]["fla"] = None if fla is None else state_bytes[B] / fla / 1e9
        row["fraction_of_copy"]["fla"] = None if fla is None else row["state_TBps"]["fla"] / copy
        row["speedup_vs_fla"] = ratio(row["ms"]["ours"], fla)
        save()
        torch.cuda.empty_cache()
    result["wall_s"] = time.monotonic() - start
    save()
    print_table(result)
    try:
        plot(result, args.out / "kda_h200.png")
    except ImportError as exc:  # re-plot later with --plot
        print(f"no plot: {exc}")


def plot(result, path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(13, 4.5), gridspec_kw={"width_ratios": [5, 3]})
    impls = [("ours", "k3 (ours)"), ("flashkda", "FlashKDA (vLLM 0.33)"), ("fla", "FLA 0.6 chunk_kda")]
    rows = [r for r in result["prefill"] if not r.get("superseded")]  # merged files keep old rows
    shapes = [r["shape"] for r in rows]
    width = 0.27
    for i, (key, label) in enumerate(impls):
        vals = [r["Mtok_per_s"][key] or 0 for r in rows]
        ax1.bar([j + (i - 1) * width for j in range(len(shapes))], vals, width, label=label)
    ax1.set_xticks(range(len(shapes)), shapes, rotation=15, fontsize=8)
    ax1.set_ylabel("prefill, M tokens/s")
    ax1.legend(fontsize=8)
    ax1.set_title(f"KDA prefill, head_dim 128, lb {LB}")
    decode = [r for r in result["decode"] if not r.get("superseded")]
    batches = [str(r["batch"]) for r in decode]
    for i, (key, label) in enumerate([("ours", "k3 (ours)"), ("fla", "FLA fused_recurrent_kda")]):
        vals = [r["state_TBps"][key] or 0 for r in decode]
        ax2.bar([j + (i - 0.5) * 0.4 for j in range(len(batches))], vals, 0.4, label=label)
    ax2.axhline(result["copy_bandwidth_TBps"], color="k", ls="--", lw=1, label="device copy")
    ax2.set_xticks(range(len(batches)), batches)
    ax2.set_xlabel("decode batch (96 heads, 1 token)")
    ax2.set_ylabel("state TB/s (read + write)")
    ax2.legend(fontsize=8)
    fig.suptitle(f"{result['gpu']}, {result['date'][:10]}, {result['commit'][:12]} / {result['source_sha256_16']}",
                 fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def print_table(result) -> None:
    def f(v, spec=".3f"):
        return "-" if v is None else format(v, spec)
    print(f"\ncopy {result['copy_bandwidth_TBps']:.2f} TB/s; errors: {list(result['errors'])}")
    print(f"{'prefill':<20}{'ours ms':>9}{'fkda ms':>9}{'fla ms':>9}{'ours Mt/s':>10}{'x fkda':>8}{'x fla':>7}"
          "  vs recurrent kernel: out / state; kernels ms")
    for r in result["prefill"]:
        c = r.get("rel_err_vs_recurrent_kernel")
        err = "-" if not c else f"{c['out']:.1e} / {c['state']:.1e}"
        kern = " ".join(f"{k.replace('_kernel', '')} {v:.3f}" for k, v in (r.get("ours_kernels_ms") or {}).items())
        print(f"{r['shape']:<20}{f(r['ms']['ours']):>9}{f(r['ms']['flashkda']):>9}{f(r['ms']['fla']):>9}"
              f"{f(r['Mtok_per_s']['ours'], '.2f'):>10}{f(r['speedup_vs_flashkda'], '.2f'):>8}"
              f"{f(r['speedup_vs_fla'], '.2f'):>7}  {err}; {kern}")
    print(f"{'decode B':<20}{'ours ms':>9}{'fla ms':>9}{'ours TB/s':>10}{'of copy':>8}{'fla TB/s':>9}"
          f"{'fla/copy':>9}  rel err out / state / conv exact")
    for r in result["decode"]:
        e = r.get("rel_err_vs_reference")
        err = "-" if not e else f"{e['out']:.1e} / {e['state']:.1e} / {e['conv_state_exact']}"
        print(f"{r['batch']:<20}{f(r['ms']['ours'], '.4f'):>9}{f(r['ms']['fla'], '.4f'):>9}"
              f"{f(r['state_TBps']['ours'], '.2f'):>10}{f(r['fraction_of_copy']['ours'], '.3f'):>8}"
              f"{f(r['state_TBps']['fla'], '.2f'):>9}{f(r['fraction_of_copy']['fla'], '.3f'):>9}  {err}")


if __name__ == "__main__":
    main()
