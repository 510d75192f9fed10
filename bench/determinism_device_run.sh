#!/usr/bin/env bash
# Issue 23 in one call on the GPU machine (repo root): build the kernels, prove that op calls
# and model steps repeat bitwise, and time the deterministic MoE combine against the previous
# one (fp32 atomics) in the same run. $OUT gets determinism_h200.json and det_logs.tgz (every
# log, junit file and benchmark JSON; the device returns at most 8 files).
#   K3_COMMIT="<sha> dirty" BASE=.k3base bench/determinism_device_run.sh
# BASE: a directory holding the previous plugins/include and moe.cu (plugins/c_api/, or
# plugins/kernels/ in trees before the rename; e.g. `git archive <commit> plugins | tar -x -C .k3base`); without
# it the A/B timing and the old-path repeat check are skipped.
# STAGES (default "moe model bench cost slice"): moe = the MoE op repeat checks and the MoE
# batch-invariant mode (new library), the repeat checks on the old one (differences recorded,
# not asserted), the MoE correctness tests; model = tiny-k3 steps twice, CUDA-graph replay vs
# eager, MLA and 16 prompts batched vs alone in the batch-invariant mode, test_model_cuda.py;
# bench = bench/moe_bench.py old/new/old/new (the second pair prefill only) and the new
# library in the MoE batch-invariant mode; cost = bench/batch_invariant_cost.py; slice =
# bench/rank_slice.py --repeat-check $RANK_SLICE_ARGS when that script exists.
set -uo pipefail
cd "$(dirname "$0")/.."
final="${OUT:-/tmp/det_out}"
out=/tmp/det_work
stages=" ${STAGES:-moe model bench cost slice} "
base="${BASE:-}"
rm -rf "$out"
mkdir -p "$out" "$final" build /tmp/k3det
export PYTHONUNBUFFERED=1
has() { [[ "$stages" == *" $1 "* ]]; }
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,temperature.gpu,driver_version --format=csv,noheader

if has model || has slice || has cost; then
  (build_scripts/build_kernels.sh build) >"$out/build_kernels.log" 2>&1 &
  kernels_pid=$!
fi
# moe.cu alone (seconds): the new library and, from BASE, the previous one.
moe_nvcc() {  # include_dir source output
  timeout 180 nvcc -std=c++17 -O3 -Xcompiler -fPIC --expt-relaxed-constexpr -lineinfo \
    -gencode arch=compute_90a,code=sm_90a -I"$1" -shared -cudart static -Xptxas -v "$2" -o "$3"
}
new=/tmp/k3det/libk3_moe.so old=/tmp/k3det/libk3_moe_base.so
moe_nvcc plugins/include plugins/c_api/moe.cu "$new" 2>"$out/ptxas_new.log" &
p1=$!
if [[ -n "$base" ]]; then
  base_moe="$base/plugins/c_api/moe.cu"
  [[ -f "$base_moe" ]] || base_moe="$base/plugins/kernels/moe.cu"  # trees before the rename
  moe_nvcc "$base/plugins/include" "$base_moe" "$old" 2>"$out/ptxas_old.log" &
  p2=$!
fi
wait $p1 || { tail -30 "$out/ptxas_new.log"; exit 1; }
if [[ -n "$base" ]]; then wait $p2 || { tail -30 "$out/ptxas_old.log"; base=""; }; fi

pt() {  # name lib pytest-args...
  local name=$1 lib=$2
  shift 2
  K3_KERNELS_LIB="$lib" timeout 300 python3 -m pytest -q -rs -p no:cacheprovider --junitxml="$out/$name.xml" "$@" \
    >"$out/$name.log" 2>&1
  echo "== $name: $(tail -1 "$out/$name.log")"
}
if has moe; then
  pt moe_repeat_new "$new" tests/gpu/test_determinism.py -k moe
  [[ -n "$base" ]] && pt moe_repeat_old "$old" tests/gpu/test_determinism.py -k moe_op
  pt moe_cuda_new "$new" tests/gpu/test_moe_cuda.py -k "not trt_plugin"
fi
if has model || has slice || has cost; then
  wait "$kernels_pid" || { echo "build_kernels.sh failed"; tail -20 "$out/build_kernels.log"; }
fi
if has model; then
  pt model_repeat "$PWD/build/libk3_kernels.so" tests/gpu/test_determinism.py -k "tiny or graph or prompts or mla" -s
  pt model_cuda "$PWD/build/libk3_kernels.so" tests/gpu/test_model_cuda.py -s
fi
if has bench && [[ -n "$base" ]]; then
  for run in old1 new1 old2 new2 inv; do
    lib=$new
    [[ $run == old* ]] && lib=$old
    args="--ours-only"
    [[ $run == *2 ]] && args="--ours-only --prefill-only"
    [[ $run == inv ]] && args="--ours-only --batch-invariant"
    mkdir -p "$out/bench_$run"
    echo "== bench $run ($args)"
    K3_KERNELS_LIB="$lib" timeout 200 python3 bench/moe_bench.py --out "$out/bench_$run" $args \
      >"$out/bench_$run.log" 2>&1 || { echo "bench $run failed"; tail -5 "$out/bench_$run.log"; }
  done
fi

if has cost; then
  K3_KERNELS_LIB="$PWD/build/libk3_kernels.so" timeout 200 python3 bench/batch_invariant_cost.py --out "$out/cost" \
    >"$out/cost.log" 2>&1 || { echo "batch_invariant_cost.py failed"; tail -5 "$out/cost.log"; }
fi
if has slice && [[ -f bench/rank_slice.py ]]; then
  K3_KERNELS_LIB="$PWD/build/libk3_kernels.so" timeout 240 python3 bench/rank_slice.py --repeat-check \
    --out "$out/rank_slice_repeat.json" ${RANK_SLICE_ARGS:-} >"$out/rank_slice.log" 2>&1
  echo "== rank_slice --repeat-check rc=$?: $(tail -3 "$out/rank_slice.log")"
fi
python3 - "$out" <<'EOF'
import datetime, glob, json, os, sys, xml.etree.ElementTree as ET
import torch
out = sys.argv[1]
res = {"device": torch.cuda.get_device_name(), "torch": torch.__version__,
       "commit": os.environ.get("K3_COMMIT", "unknown"),
       "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
       "tests": {}, "moe_bench": {}}
for f in sorted(glob.glob(f"{out}/*.xml")):
    suite = ET.parse(f).getroot()
    suite = suite if suite.tag == "testsuite" else suite[0]
    cases = {}
    for c in suite.iter("testcase"):
        bad = c.find("failure") if c.find("failure") is not None else c.find("error")
        skip = c.find("skipped")
        cases[c.get("name")] = ("failed: " + (bad.get("message") or "")[:300]) if bad is not None else \
            ("skipped" if skip is not None else "passed")
    res["tests"][os.path.basename(f)[:-4]] = {k: suite.get(k) for k in ("tests", "failures", "errors", "skipped")} | \
        {"cases": cases}
for run in ("old1", "new1", "old2", "new2", "inv"):
    p = f"{out}/bench_{run}/moe_h200.json"
    if os.path.exists(p):
        d = json.load(open(p))
        res["moe_bench"][run] = {"prefill": {k: {"ms": v["ours_ms"], "kernel_ms": v["kernel_ms"]}
                                             for k, v in d["prefill"].items()},
                                 "decode": {k: v["ours_ms"] for k, v in d["decode"].items()}}
b = res["moe_bench"]
rows = []
for kind in ("bf16", "mxfp4"):
    olds = [b[r]["prefill"][kind]["ms"] for r in ("old1", "old2") if r in b]
    news = [b[r]["prefill"][kind]["ms"] for r in ("new1", "new2") if r in b]
    if olds and news:
        rows.append((f"prefill {kind} T=4096", olds, news))
for key in (b.get("old1", {}).get("decode", {})):
    if key in b.get("new1", {}).get("decode", {}):
        rows.append((f"decode {key}", [b["old1"]["decode"][key]], [b["new1"]["decode"][key]]))
res["moe_old_vs_new_ms"] = {name: {"old": o, "new": n, "new_over_old": min(n) / min(o)} for name, o, n in rows}
inv = []  # the batch-invariant mode against the default (both new), same run
if "inv" in b and "new1" in b:
    for kind in ("bf16", "mxfp4"):
        inv.append((f"prefill {kind} T=4096", b["new1"]["prefill"][kind]["ms"], b["inv"]["prefill"][kind]["ms"]))
    inv += [(f"decode {k}", v, b["inv"]["decode"][k]) for k, v in b["new1"]["decode"].items() if k in b["inv"]["decode"]]
if os.path.exists(f"{out}/cost/batch_invariant_cost.json"):
    res["torch_batch_invariant_cost"] = json.load(open(f"{out}/cost/batch_invariant_cost.json"))["cases"]
res["moe_batch_invariant_vs_default_ms"] = {n: {"default": d, "batch_invariant": i, "ratio": i / d} for n, d, i in inv}
json.dump(res, open(f"{out}/determinism_h200.json", "w"), indent=1)
for name, t in res["tests"].items():
    print(f"{name}: {t['tests']} tests, {t['failures']} failures, {t['errors']} errors, {t['skipped']} skipped")
for name, c in res.get("torch_batch_invariant_cost", {}).items():
    print(f"torch {name}: default {c['default_ms']:.4f} ms, invariant {c['batch_invariant_ms']:.4f} ms, x{c['ratio']:.2f}")
for name, d, i in inv:
    print(f"batch-invariant {name}: default {d:.3f} ms, invariant {i:.3f} ms, x{i / d:.2f}")
for name, o, n in rows:
    print(f"{name}: old {' '.join(f'{x:.3f}' for x in o)} ms, new {' '.join(f'{x:.3f}' for x in n)} ms, "
          f"new/old {min(n) / min(o):.3f}")
EOF
cp "$out/determinism_h200.json" "$final/" 2>/dev/null
tar czf "$final/det_logs.tgz" -C "$out" .
