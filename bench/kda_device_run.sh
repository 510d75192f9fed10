#!/usr/bin/env bash
# One call on the GPU machine: build kda.cu on its own (so a sibling kernel source being
# edited cannot break it), run the CUDA tests, then the benchmark; logs and results in $OUT.
#   bench/kda_device_run.sh [kda_bench.py args]   (FLA wheel in .whl/, FlashKDA in .carry/)
set -uo pipefail
cd "$(dirname "$0")/.."
out="${OUT:-/tmp/kda_out}"
mkdir -p "$out" /tmp/k3kda
if ls .whl/fla_core-*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/fla_core-*.whl && export PYTHONPATH=/tmp/site
fi
lib=/tmp/k3kda/libk3_kda.so
timeout 150 nvcc -std=c++17 -O3 -Xcompiler -fPIC --expt-relaxed-constexpr -lineinfo \
  -gencode arch=compute_90a,code=sm_90a -Iplugins/include -shared -cudart static \
  -Xptxas -v plugins/kernels/kda.cu -o "$lib" 2>"$out/ptxas.log" || { cat "$out/ptxas.log"; exit 1; }
export K3_KERNELS_LIB="$lib" PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,temperature.gpu --format=csv,noheader
timeout 150 python3 -m pytest tests/gpu/test_kda_cuda.py -q -s 2>&1 | tee "$out/test.log" | grep -E "rel err|passed|failed|Error|error"
timeout 200 python3 bench/kda_bench.py --out "$out" "$@" 2>&1 | tee "$out/bench.log" | grep -vE "^\{"
