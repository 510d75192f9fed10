#!/usr/bin/env bash
# One device call for an A/B of the MoE decode kernels (repo root): builds `before` from BASE's
# plugins/c_api/moe.cu and plugins/include (the previous kernels, self-contained), and one
# library per entry of VARIANTS from the working tree (name|extra nvcc flags, entries separated
# by ';'; default one library `new` without flags), all in parallel. Then
# tests/gpu/test_moe_cuda.py (TEST_K, default: everything but the TensorRT plugin cases, which
# need the full plugin build) on each library named in TEST_LIBS (default: all but before),
# then bench/moe_bench.py --decode-only (BENCH_ARGS, e.g. --kinds mxfp4) for each name of ORDER
# (default: before, the variants, then the same again), so all land in one process order and
# one copy-bandwidth regime. Results in $OUT: decode_runs.jsonl (one line per run, labelled),
# test.log, bench.log, ptxas.log.
#   mkdir -p .h5base && git archive HEAD plugins/include plugins/c_api/moe.cu | tar -x -C .h5base
#   K3_COMMIT="$(git rev-parse HEAD)+dirty" BASE=.h5base bench/moe_decode_device_run.sh
set -uo pipefail
cd "$(dirname "$0")/.."
out="${OUT:-/tmp/moe_decode_out}"
base="${BASE:?BASE: a directory holding the previous plugins/c_api/moe.cu and plugins/include}"
mkdir -p "$out" /tmp/k3moe
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD"
build() {  # name, source, then nvcc flags (include dirs, -D)
  local name=$1 src=$2
  shift 2
  timeout 300 nvcc -std=c++17 -O3 -Xcompiler -fPIC --expt-relaxed-constexpr -lineinfo \
    -gencode arch=compute_90a,code=sm_90a -shared -cudart static -Xptxas -v "$@" \
    "$src" -o "/tmp/k3moe/$name.so" >"/tmp/k3moe/build_$name.log" 2>&1
}
IFS=';' read -ra entries <<<"${VARIANTS:-new|}"
names=()
declare -A pids
build before "$base/plugins/c_api/moe.cu" -I"$base/plugins/include" & pids[before]=$!
for entry in "${entries[@]}"; do
  name=${entry%%|*}
  read -ra flags <<<"${entry#*|}"
  names+=("$name")
  build "$name" plugins/c_api/moe.cu -Iplugins/include "${flags[@]}" & pids[$name]=$!
done
for name in before "${names[@]}"; do
  wait "${pids[$name]}" || { echo "build of $name failed"; tail -20 "/tmp/k3moe/build_$name.log"; exit 1; }
  grep -A2 "decode_kernel" "/tmp/k3moe/build_$name.log" | grep -E "Compiling|Used|spill" | sed "s/^/$name /"
done >"$out/ptxas.log"
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,temperature.gpu --format=csv,noheader
for name in ${TEST_LIBS:-${names[*]}}; do
  K3_KERNELS_LIB="/tmp/k3moe/$name.so" timeout 300 python3 -m pytest tests/gpu/test_moe_cuda.py -rs -s \
    -k "${TEST_K:-not trt_plugin}" -p no:cacheprovider >"$out/test_$name.log" 2>&1
  echo "tests ($name): $(tail -1 "$out/test_$name.log")"
  grep -E "K3 .*rel err" "$out/test_$name.log" | sed "s/^/  /"
done
for name in ${ORDER:-before ${names[*]} ${names[*]} before}; do
  # shellcheck disable=SC2086  # BENCH_ARGS: several words
  K3_KERNELS_LIB="/tmp/k3moe/$name.so" timeout 200 python3 bench/moe_bench.py --decode-only --ours-only \
    --label "$name" --out "$out" ${BENCH_ARGS:-} >>"$out/bench.log" 2>&1 || echo "bench $name failed (see bench.log)"
  tail -4 "$out/bench.log"
done
rm -f "$out/moe_decode_h200.json"
