#!/usr/bin/env bash
# On a GPU machine, one command: build the kernel library and, in parallel, the TensorRT plugin
# library with its test harness, then run every GPU test. Without TensorRT's headers
# (TENSORRT_INCLUDE_DIR, default third_party/tensorrt/include) the plugin tests skip.
#   tests/gpu/run_all.sh [pytest args]
set -uo pipefail
cd "$(dirname "$0")/../.."
export TENSORRT_INCLUDE_DIR="${TENSORRT_INCLUDE_DIR:-$PWD/third_party/tensorrt/include}"
mkdir -p build
build_scripts/build_kernels.sh build &
kernels=$!
if [[ -f "$TENSORRT_INCLUDE_DIR/NvInferRuntime.h" ]]; then
  build_scripts/build_plugins.sh build &
  plugins=$!
fi
wait "$kernels" || { echo "run_all.sh: kernel library build failed" >&2; exit 1; }
if [[ -n "${plugins:-}" ]] && ! wait "$plugins"; then
  echo "run_all.sh: plugin library build failed" >&2
  exit 1
fi
python3 -m pytest tests/gpu -q -rs -p no:cacheprovider "$@"
