#!/usr/bin/env bash
# One call on the GPU machine (repo root, third_party/tensorrt carried): build the MoE kernels,
# run the CUDA tests against the fp32 reference, the TensorRT plugin cases through the harness,
# then the benchmark; logs and bench/moe_h200.json-style results in $OUT.
#   bench/moe_device_run.sh
# MOE_ONLY=1: build moe.cu alone and skip the full libraries and the plugin cases (iteration
# calls); MOE_BENCH_ARGS: extra arguments for moe_bench.py (e.g. --prefill-only, which also skips the
# decode-only kernel breakdown; --ep8-prefill --kinds mxfp4 --ours-only for the rank-slice prefill);
# MOE_LIB: a libk3_moe.so prebuilt elsewhere (nvcc -gencode arch=compute_90a,code=sm_90a as below),
# used instead of building moe.cu here.
set -uo pipefail
cd "$(dirname "$0")/.."
out="${OUT:-/tmp/moe_out}"
moe_only="${MOE_ONLY:-0}"
mkdir -p "$out" build /tmp/k3moe
export TENSORRT_INCLUDE_DIR="${TENSORRT_INCLUDE_DIR:-$PWD/third_party/tensorrt/include}" PYTHONUNBUFFERED=1
if [ "$moe_only" != 1 ]; then
  # Full libraries in the background: build/libk3_kernels.so, build/libk3_trt_plugins.so and the harness.
  ( build_scripts/build_kernels.sh build ) >"$out/build_kernels.log" 2>&1 &
  kernels_pid=$!
  build_scripts/build_plugins.sh build >"$out/build_plugins.log" 2>&1 &
  plugins_pid=$!
fi
# moe.cu on its own first (seconds), so the op tests need not wait for the other kernels.
lib="${MOE_LIB:-/tmp/k3moe/libk3_moe.so}"
[ -n "${MOE_LIB:-}" ] || timeout 120 nvcc -std=c++17 -O3 -Xcompiler -fPIC --expt-relaxed-constexpr -lineinfo -gencode arch=compute_90a,code=sm_90a \
  -Iplugins/include -shared -cudart static -Xptxas -v plugins/c_api/moe.cu -o "$lib" 2>"$out/ptxas.log" \
  || { cat "$out/ptxas.log"; exit 1; }
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,temperature.gpu --format=csv,noheader
K3_KERNELS_LIB="$lib" timeout 240 python3 -m pytest tests/gpu/test_moe_cuda.py -s -rs -k "not trt_plugin" 2>&1 \
  | tee "$out/test.log" | grep -E "rel err|router logits|passed|failed|FAILED|Error|error|SKIP" | tail -40
if [ "$moe_only" != 1 ]; then
  wait "$kernels_pid" || { echo "build_kernels.sh failed"; tail -20 "$out/build_kernels.log"; }
  wait "$plugins_pid" || { echo "build_plugins.sh failed"; tail -20 "$out/build_plugins.log"; }
  timeout 120 python3 -m pytest tests/gpu/test_moe_cuda.py -s -rs -k "trt_plugin" 2>&1 \
    | tee "$out/test_plugin.log" | grep -E "passed|failed|FAILED|Error|error|SKIP" | tail -20
fi
case " ${MOE_BENCH_ARGS:-} " in
  *" --prefill-only "*) ;;  # the breakdown covers the decode sizes only
  *) K3_KERNELS_LIB="$lib" timeout 120 python3 bench/moe_kernel_breakdown.py --out "$out" 2>&1 | tee "$out/breakdown.log" | tail -8 ;;
esac
K3_KERNELS_LIB="$lib" timeout 240 python3 bench/moe_bench.py --out "$out" ${MOE_BENCH_ARGS:-} 2>&1 | tee "$out/bench.log" | tail -20
