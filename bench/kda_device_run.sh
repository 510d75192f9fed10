#!/usr/bin/env bash
# One call on the GPU machine: build kda.cu on its own (so a sibling kernel source being
# edited cannot break it), run the CUDA tests, then the benchmark; logs and results in $OUT.
#   [KDA_VARIANTS="name:-DFLAG[,-DFLAG2] ..."] bench/kda_device_run.sh [kda_bench.py args]
# FLA wheel in .whl/, FlashKDA in .carry/. Each variant is built in parallel with the main
# library and benchmarked after the main run, ours only (no peers): $OUT/<name>.json.
set -uo pipefail
cd "$(dirname "$0")/.."
out="${OUT:-/tmp/kda_out}"
mkdir -p "$out" /tmp/k3kda
if ls .whl/fla_core-*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/fla_core-*.whl && export PYTHONPATH=/tmp/site
fi
build() {  # build LIB [nvcc flags]
  local lib=$1
  shift
  timeout 150 nvcc -std=c++17 -O3 -Xcompiler -fPIC --expt-relaxed-constexpr -lineinfo \
    -gencode arch=compute_90a,code=sm_90a -Iplugins/include -shared -cudart static \
    -Xptxas -v "$@" plugins/c_api/kda.cu -o "$lib"
}
lib=/tmp/k3kda/libk3_kda.so
build "$lib" 2>"$out/ptxas.log" &
main_build=$!
for v in ${KDA_VARIANTS:-}; do
  flags="${v#*:}"
  build "/tmp/k3kda/lib_${v%%:*}.so" ${flags//,/ } 2>"/tmp/k3kda/ptxas_${v%%:*}.log" &
done
wait "$main_build" || { cat "$out/ptxas.log"; exit 1; }
wait
export K3_KERNELS_LIB="$lib" PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,temperature.gpu --format=csv,noheader
timeout "${KDA_TEST_TIMEOUT:-150}" python3 -m pytest tests/gpu/test_kda_cuda.py -q -s 2>&1 | tee "$out/test.log" | grep -E "rel err|passed|failed|Error|error"
timeout "${KDA_BENCH_TIMEOUT:-200}" python3 bench/kda_bench.py --out "$out" "$@" 2>&1 | tee "$out/bench.log" | grep -vE "^\{"
for v in ${KDA_VARIANTS:-}; do
  name="${v%%:*}"
  [ -f "/tmp/k3kda/lib_$name.so" ] || { echo "variant $name: build failed"; tail -5 "/tmp/k3kda/ptxas_$name.log"; continue; }
  echo "== variant $name (${v#*:})"
  K3_KERNELS_LIB="/tmp/k3kda/lib_$name.so" timeout "${KDA_VARIANT_TIMEOUT:-120}" python3 bench/kda_bench.py --out "/tmp/k3kda/out_$name" \
    "$@" --no-fla --flashkda /nonexistent 2>&1 | grep -vE "^\{|Traceback|^  |Error"
  cp "/tmp/k3kda/out_$name/kda_h200.json" "$out/$name.json" 2>/dev/null
done
