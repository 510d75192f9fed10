#!/usr/bin/env bash
# One device call for an A/B of the MoE decode kernels (repo root): builds plugins/c_api/moe.cu
# twice, against BASE's headers (the previous kernels) and against the working tree's, runs
# tests/gpu/test_moe_cuda.py on the new library (TensorRT plugin cases excluded: they need the
# full plugin build), then bench/moe_bench.py --decode-only for before, new, before, new, so
# both land in one process order and one copy-bandwidth regime. Results in $OUT:
# decode_runs.jsonl (one line per run, labelled), test.log, bench.log, ptxas.log.
#   mkdir -p .k3base && git archive HEAD plugins/include | tar -x -C .k3base   # here; carry .k3base
#   K3_COMMIT="$(git rev-parse HEAD) + working tree" BASE=.k3base bench/moe_decode_device_run.sh
set -uo pipefail
cd "$(dirname "$0")/.."
out="${OUT:-/tmp/moe_decode_out}"
base="${BASE:?BASE: a directory holding the previous plugins/include}"
mkdir -p "$out" /tmp/k3moe
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD"
build() {  # name, include dirs first
  local name=$1
  shift
  timeout 300 nvcc -std=c++17 -O3 -Xcompiler -fPIC --expt-relaxed-constexpr -lineinfo \
    -gencode arch=compute_90a,code=sm_90a -shared -cudart static -Xptxas -v "$@" -Iplugins/include \
    plugins/c_api/moe.cu -o "/tmp/k3moe/$name.so" >"/tmp/k3moe/build_$name.log" 2>&1
}
build before -I"$base/plugins/include" & before_pid=$!
build new & new_pid=$!
wait "$before_pid" || { echo "build of BASE's kernels failed"; tail -20 /tmp/k3moe/build_before.log; exit 1; }
wait "$new_pid" || { echo "build of the new kernels failed"; tail -20 /tmp/k3moe/build_new.log; exit 1; }
for name in before new; do
  grep -A2 "decode_kernel" "/tmp/k3moe/build_$name.log" | grep -E "Compiling|Used|spill" | sed "s/^/$name /"
done >"$out/ptxas.log"
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,temperature.gpu --format=csv,noheader
K3_KERNELS_LIB=/tmp/k3moe/new.so timeout 300 python3 -m pytest tests/gpu/test_moe_cuda.py -rs -s -k "not trt_plugin" \
  -p no:cacheprovider >"$out/test.log" 2>&1
echo "tests (new): $(tail -1 "$out/test.log")"
grep -E "K3 decode" "$out/test.log"
for name in before new before new; do
  K3_KERNELS_LIB="/tmp/k3moe/$name.so" timeout 200 python3 bench/moe_bench.py --decode-only --ours-only \
    --label "$name" --out "$out" >>"$out/bench.log" 2>&1 || echo "bench $name failed (see bench.log)"
  tail -7 "$out/bench.log"
done
rm -f "$out/moe_decode_h200.json"
