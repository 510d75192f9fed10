"""KDA prefill builds side by side in one process (ours only; the peers are in kda_bench.py).

Run on the GPU machine:
    python3 bench/kda_prefill_variants.py --out DIR --lib NAME=PATH [--lib NAME=PATH ...]
        [--shapes T4096_H96 ...] [--rounds 2] [--flashkda PATH]
Each --lib is a full kda.cu build: the tree, or the tree with a measurement switch added for
the comparison at hand (the sources keep none since session 18; the earlier ones are in git
history, baada2a). Every shape times every build on
the same inputs in `rounds` interleaved passes (triton.testing.do_bench medians, L2 flushed),
then takes one torch-profiler breakdown per build (device ms per kernel); with --flashkda,
FlashKDA (vllm 0.33.0's ``_flashkda_C.abi3.so``, from post-conv q/k/v) is timed in the same
rounds as the row "flashkda". A measurement build may produce wrong outputs on purpose (one
that stops the prepare early, say): no correctness check
against the fp32 reference here; kda_bench.py and tests/gpu/test_kda_cuda.py check the shipped
build. Each build's output and final state are compared with the first build's on the same
inputs (`vs_first`: relative Frobenius errors and whether they are bit-identical), so that a
variant that only moves data shows itself exact. Writes DIR/kda_prefill_variants.json.
"""
from __future__ import annotations

import argparse
import ctypes
import datetime
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import kda_bench as kb  # noqa: E402  (inputs, timing)
from k3_trtllm.ops.kda import cuda as kda_cuda  # noqa: E402


def load(path: str) -> ctypes.CDLL:
    lib = ctypes.CDLL(path)
    lib.k3_kda_prefill.argtypes = kda_cuda._ARGTYPES
    lib.k3_kda_prefill.restype = ctypes.c_int
    main = kda_cuda._library().k3_kda_prefill_workspace_bytes  # the binding's signature
    lib.k3_kda_prefill_workspace_bytes.argtypes = main.argtypes
    lib.k3_kda_prefill_workspace_bytes.restype = main.restype
    return lib


def run_once(lib, x) -> dict:
    """Out and final state of one prefill call on copies of the inputs (output poisoned)."""
    mine = dict(x, conv_state=x["conv_state"].clone(), recurrent_state=x["recurrent_state"].clone(),
                out=torch.full_like(x["out"], float("nan")))
    kb.ours("k3_kda_prefill", mine, lib)()
    torch.cuda.synchronize()
    return dict(out=mine["out"], state=mine["recurrent_state"])


def compare(mine: dict, first: dict) -> dict:
    def rel(a, b):
        return float((a.double() - b.double()).norm() / b.double().norm())
    return dict(out=rel(mine["out"], first["out"]), state=rel(mine["state"], first["state"]),
                bit_identical=bool(torch.equal(mine["out"], first["out"]) and torch.equal(mine["state"], first["state"])))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--lib", action="append", required=True, metavar="NAME=PATH")
    ap.add_argument("--shapes", nargs="+", default=[s[0] for s in kb.PREFILL_SHAPES])
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--flashkda", type=Path, help="FlashKDA's _flashkda_C.abi3.so, timed as a peer")
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    libs = {name: load(path) for name, path in (s.split("=", 1) for s in args.lib)}
    rows, errors = [], {}
    if args.flashkda:
        try:
            torch.ops.load_library(str(args.flashkda))
        except Exception as exc:
            errors["flashkda_load"] = f"{type(exc).__name__}: {exc}"
    torch.manual_seed(0)
    for shape, lengths, H in (s for s in kb.PREFILL_SHAPES if s[0] in args.shapes):
        x = kb.inputs(lengths, H)
        vs_first, first = {}, None
        for name, lib in libs.items():
            try:
                res = run_once(lib, x)
                first = first or res
                vs_first[name] = compare(res, first)
            except Exception as exc:
                errors[f"check/{name}/{shape}"] = f"{type(exc).__name__}: {exc}"
        del first
        runs = {name: kb.ours("k3_kda_prefill", x, lib) for name, lib in libs.items()}
        if args.flashkda and "flashkda_load" not in errors:
            runs["flashkda"] = kb.flashkda(x)
        ms = {name: [] for name in runs}
        for _ in range(args.rounds):
            for name, fn in runs.items():
                try:
                    ms[name].append(kb.median_ms(fn))
                except Exception as exc:
                    errors[f"{name}/{shape}"] = f"{type(exc).__name__}: {exc}"
        for name, times in ms.items():
            if not times:
                continue
            kern = None
            if name in libs:
                try:
                    kern = kb.kernel_breakdown(x, libs[name])
                except Exception as exc:
                    errors[f"profile/{name}/{shape}"] = f"{type(exc).__name__}: {exc}"
            t = sum(times) / len(times)
            rows.append(dict(variant=name, shape=shape, tokens=x["T"], heads=H, seqs=x["B"], ms=t,
                             ms_rounds=times, Mtok_per_s=x["T"] / t / 1e3, kernels_ms=kern,
                             vs_first=vs_first.get(name)))
            print(json.dumps(rows[-1]), flush=True)
        del x, runs
        torch.cuda.empty_cache()
    result = dict(gpu=torch.cuda.get_device_name(), date=datetime.datetime.now(datetime.timezone.utc).isoformat(),
                  commit=kb.commit_id(), source_sha256_16=kb.source_hash(), torch=torch.__version__,
                  libs=dict(s.split("=", 1) for s in args.lib), prefill=rows, errors=errors)
    fkda = {r["shape"]: r["ms"] for r in rows if r["variant"] == "flashkda"}
    for r in rows:
        if r["shape"] in fkda and r["variant"] != "flashkda":
            r["speedup_vs_flashkda"] = fkda[r["shape"]] / r["ms"]
    (args.out / "kda_prefill_variants.json").write_text(json.dumps(result, indent=2))
    print(f"{'variant':<14}{'shape':<20}{'ms':>9}{'x fkda':>8}  vs first: out / state / identical; kernels ms")
    for r in rows:
        kern = " ".join(f"{k.replace('_kernel', '')} {v:.3f}" for k, v in (r["kernels_ms"] or {}).items())
        c = r["vs_first"]
        cmp = "-" if c is None else f"{c['out']:.1e} / {c['state']:.1e} / {c['bit_identical']}"
        x = r.get("speedup_vs_flashkda")
        print(f"{r['variant']:<14}{r['shape']:<20}{r['ms']:>9.4f}{'-' if x is None else format(x, '.2f'):>8}  {cmp}; {kern}")
    for k, v in errors.items():
        print(f"error {k}: {v}")


if __name__ == "__main__":
    main()
