#!/usr/bin/env bash
# On a GPU machine, one command: build the kernel library, the TensorRT plugin library and its
# test harness (in parallel), then run every GPU test. Without TensorRT's headers
# (TENSORRT_INCLUDE_DIR, default third_party/tensorrt/include) the plugin tests skip.
#   tests/gpu/run_all.sh [pytest args]
set -uo pipefail
cd "$(dirname "$0")/../.."
export TENSORRT_INCLUDE_DIR="${TENSORRT_INCLUDE_DIR:-$PWD/third_party/tensorrt/include}"
nvcc="${NVCC:-nvcc}"
mkdir -p build
build_scripts/build_kernels.sh build &
kernels=$!
if [[ -f "$TENSORRT_INCLUDE_DIR/NvInferRuntime.h" ]]; then
  ( build_scripts/build_plugins.sh build &&
    "$nvcc" -std=c++17 -shared -Xcompiler -fPIC -isystem "$TENSORRT_INCLUDE_DIR" \
      plugins/trt/harness/plugin_harness.cpp -o build/libk3_trt_harness.so -ldl ) &
  plugins=$!
fi
wait "$kernels" || { echo "run_all.sh: kernel library build failed" >&2; exit 1; }
if [[ -n "${plugins:-}" ]] && ! wait "$plugins"; then
  echo "run_all.sh: plugin library build failed" >&2
  exit 1
fi
python3 -m pytest tests/gpu -q -rs -p no:cacheprovider "$@"
