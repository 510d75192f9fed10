"""KDA decode builds side by side in one process: state bytes per second against the copy rate.

Run on the GPU machine:
    python3 bench/kda_decode_bench.py --out DIR --lib NAME=PATH [--lib NAME=PATH ...]
        [--batches 1 64 128 256] [--check-batches 64 256] [--rounds 2] [--rep-ms 300] [--fla]
Each --lib is a shared library exporting ``k3_kda_decode`` (the full kda.cu build, or a
decode-only build of a variant). Every batch (96 heads x 128, one token per sequence, lb -5)
times every build on the same inputs, in `rounds` interleaved passes, with
triton.testing.do_bench medians over --rep-ms (L2 flushed); the copy rate is measured in the same process
before and after. Builds are checked against the fp32 reference op on the CPU (output and
state relative Frobenius errors; the conv state must match exactly) at --check-batches.
--fla adds FLA 0.6's fused_recurrent_kda. Writes DIR/kda_decode.json.
"""
from __future__ import annotations

import argparse
import ctypes
import datetime
import json
import sys
import traceback
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import kda_bench as kb  # noqa: E402  (inputs, timing and the peers)
from k3_trtllm.ops.kda import cuda as kda_cuda  # noqa: E402

HEADS = kb.DECODE_HEADS
ARGTYPES = kda_cuda._ARGTYPES  # const K3KdaParams*, stream


def load(path: str) -> ctypes.CDLL:
    lib = ctypes.CDLL(path)
    lib.k3_kda_decode.argtypes = ARGTYPES
    lib.k3_kda_decode.restype = ctypes.c_int
    return lib


def median_ms(fn, rep_ms: int) -> float:
    import triton.testing
    fn()
    torch.cuda.synchronize()
    return float(triton.testing.do_bench(fn, warmup=25, rep=rep_ms, return_mode="median"))


def reference(x) -> dict:
    import k3_trtllm.ops.kda  # noqa: F401  (registers the reference ops)
    cpu = {k: x[k].cpu() for k in kb.STATE_KEYS}
    out = torch.ops.k3.kda_decode(*(cpu[k] for k in kb.STATE_KEYS), x["H"], kb.D, kb.LB)
    return dict(out=out, state=cpu["recurrent_state"], conv=cpu["conv_state"])


def check(lib, x, ref) -> dict:
    mine = dict(x, conv_state=x["conv_state"].clone(), recurrent_state=x["recurrent_state"].clone(),
                out=torch.full_like(x["out"], float("nan")))  # poisoned: every element must be written
    kb.ours("k3_kda_decode", mine, lib)()
    torch.cuda.synchronize()

    def rel(a, b):
        a, b = a.double().cpu(), b.double()
        return float((a - b).norm() / b.norm())
    return dict(out=rel(mine["out"], ref["out"]), state=rel(mine["recurrent_state"], ref["state"]),
                conv_state_exact=bool(torch.equal(mine["conv_state"].cpu(), ref["conv"]))), mine


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--lib", action="append", required=True, metavar="NAME=PATH")
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 64, 128, 256])
    ap.add_argument("--check-batches", type=int, nargs="*", default=[64, 256])
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--rep-ms", type=int, default=300)
    ap.add_argument("--fla", action="store_true")
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    libs = {}
    errors: dict[str, str] = {}
    for spec in args.lib:
        name, path = spec.split("=", 1)
        try:
            libs[name] = load(path)
        except OSError as exc:
            errors[f"load/{name}"] = str(exc)

    torch.manual_seed(0)
    copy_before = kb.copy_bandwidth_tbs()
    rows = []
    for B in args.batches:
        x = kb.inputs([1] * B, HEADS)
        state_bytes = 2 * B * HEADS * kb.D * kb.D * 4  # fp32 state read + written
        runs = {name: kb.ours("k3_kda_decode", x, lib) for name, lib in libs.items()}
        if args.fla:
            runs["fla"] = kb.fla_recurrent(x)
        ms = {name: [] for name in runs}
        for _ in range(args.rounds):
            for name, fn in runs.items():
                try:
                    ms[name].append(median_ms(fn, args.rep_ms))
                except Exception as exc:
                    errors[f"{name}/decode{B}"] = f"{type(exc).__name__}: {exc}"
                    traceback.print_exc()
        checks = {}
        if B in args.check_batches:
            ref = reference(x)
            first = None  # every build's out, conv and state bitwise against the first --lib's
            for name, lib in libs.items():
                try:
                    checks[name], mine = check(lib, x, ref)
                    got = [mine[k] for k in ("out", "conv_state", "recurrent_state")]
                    first = first or got
                    checks[name]["bitwise_vs_first"] = all(torch.equal(a, b) for a, b in zip(got, first))
                except Exception as exc:
                    errors[f"check/{name}/decode{B}"] = f"{type(exc).__name__}: {exc}"
        for name, times in ms.items():
            if not times:
                continue
            t = sum(times) / len(times)
            rows.append(dict(variant=name, batch=B, heads=HEADS, ms=t, ms_rounds=times,
                             state_TBps=state_bytes / t / 1e9, rel_err_vs_reference=checks.get(name)))
            print(json.dumps(rows[-1]), flush=True)
        del x, runs
        torch.cuda.empty_cache()
    copy_after = kb.copy_bandwidth_tbs()
    copy = (copy_before + copy_after) / 2
    for r in rows:
        r["fraction_of_copy"] = r["state_TBps"] / copy
    result = dict(gpu=torch.cuda.get_device_name(), date=datetime.datetime.now(datetime.timezone.utc).isoformat(),
                  commit=kb.commit_id(), source_sha256_16=kb.source_hash(), torch=torch.__version__,
                  libs=dict(s.split("=", 1) for s in args.lib), head_dim=kb.D, conv_width=kb.W,
                  lower_bound=kb.LB, rep_ms=args.rep_ms, copy_bandwidth_TBps=dict(before=copy_before, after=copy_after),
                  decode=rows, errors=errors)
    (args.out / "kda_decode.json").write_text(json.dumps(result, indent=2))
    print(f"copy {copy_before:.3f} / {copy_after:.3f} TB/s")
    print(f"{'variant':<14}{'B':>5}{'ms':>10}{'TB/s':>8}{'of copy':>9}  check")
    for r in rows:
        c = r["rel_err_vs_reference"]
        cs = "" if c is None else (f"out {c['out']:.1e} state {c['state']:.1e} conv {c['conv_state_exact']}"
                                   f" bitwise {c['bitwise_vs_first']}")
        print(f"{r['variant']:<14}{r['batch']:>5}{r['ms']:>10.4f}{r['state_TBps']:>8.3f}"
              f"{r['fraction_of_copy']:>9.1%}  {cs}")
    for k, v in errors.items():
        print(f"error {k}: {v}")


if __name__ == "__main__":
    main()
