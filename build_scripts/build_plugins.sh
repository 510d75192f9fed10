#!/usr/bin/env bash
# Builds the TensorRT plugin library libk3_trt_plugins.so: the IPluginV3 plugins in
# plugins/trt/ over the CUDA kernels in plugins/c_api/ (KDA, MLA, MoE), and
# libk3_trt_harness.so, which drives the plugins the way TensorRT does (tests/gpu/).
#   TENSORRT_INCLUDE_DIR=/path/to/TensorRT/include build_scripts/build_plugins.sh [OUT_DIR]   (default: build/)
# Compiles against TensorRT's public headers only and links no TensorRT library (the
# library exports getCreators and setLoggerFinder, which is all IPluginRegistry::loadLibrary
# needs); cudart is linked statically. Env: NVCC (default nvcc), K3_CUDA_ARCHS (default "90a").
set -euo pipefail
if [[ -z "${TENSORRT_INCLUDE_DIR:-}" ]]; then
  echo "build_plugins.sh: TENSORRT_INCLUDE_DIR is not set: point it at TensorRT's include/ (NvInferRuntime.h;" \
       "NVIDIA/TensorRT on GitHub, Apache-2.0, or a TensorRT install)" >&2
  exit 2
fi
if [[ ! -f "$TENSORRT_INCLUDE_DIR/NvInferRuntime.h" ]]; then
  echo "build_plugins.sh: $TENSORRT_INCLUDE_DIR/NvInferRuntime.h not found" >&2
  exit 2
fi
here="$(cd "$(dirname "$0")/.." && pwd)"
out="${1:-$here/build}"
nvcc="${NVCC:-nvcc}"
archs="${K3_CUDA_ARCHS:-90a}"
obj="$out/obj_trt_plugins"
mkdir -p "$obj"
gencode=()
for a in $archs; do gencode+=("-gencode" "arch=compute_${a},code=sm_${a}"); done
# Every object compiles at once (the kernel sources take tens of seconds each).
objs=() pids=()
for src in "$here"/plugins/c_api/*.cu; do
  o="$obj/$(basename "${src%.cu}").o"
  "$nvcc" -std=c++17 -O3 -Xcompiler -fPIC,-fvisibility=hidden --expt-relaxed-constexpr -lineinfo \
    "${gencode[@]}" -I"$here/plugins/include" -c "$src" -o "$o" &
  objs+=("$o") pids+=($!)
done
for src in "$here"/plugins/trt/*.cpp; do
  o="$obj/$(basename "${src%.cpp}").o"
  # host code; nvcc hands it to the host compiler with the CUDA include path
  "$nvcc" -std=c++17 -O2 -Xcompiler -fPIC,-fvisibility=hidden,-Wall,-Wno-deprecated-declarations \
    -isystem "$TENSORRT_INCLUDE_DIR" -I"$here/plugins/trt" -I"$here/plugins/include" -c "$src" -o "$o" &
  objs+=("$o") pids+=($!)
done
# The harness (host code, plugins/trt/harness/) loads the library with dlopen; it links nothing of it.
"$nvcc" -std=c++17 -shared -Xcompiler -fPIC -isystem "$TENSORRT_INCLUDE_DIR" \
  "$here/plugins/trt/harness/plugin_harness.cpp" -o "$out/libk3_trt_harness.so.tmp" -ldl &
pids+=($!)
failed=0
for pid in "${pids[@]}"; do wait "$pid" || failed=1; done
if [[ $failed -ne 0 ]]; then
  echo "build_plugins.sh: a source failed to compile (nvcc's messages above)" >&2
  exit 1
fi
map="$obj/exports.map"
printf '{\n  global: getCreators; setLoggerFinder;\n  local: *;\n};\n' > "$map"
"$nvcc" -shared -cudart static "${gencode[@]}" "${objs[@]}" -o "$out/libk3_trt_plugins.so.tmp" \
  -Xlinker --version-script="$map" -Xlinker --no-undefined
mv "$out/libk3_trt_plugins.so.tmp" "$out/libk3_trt_plugins.so"
mv "$out/libk3_trt_harness.so.tmp" "$out/libk3_trt_harness.so"
echo "$out/libk3_trt_plugins.so"
