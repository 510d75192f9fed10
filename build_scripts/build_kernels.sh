#!/usr/bin/env bash
# Builds the framework-free CUDA kernels (plugins/c_api/*.cu, C ABI) into one shared
# library that the torch bindings (ctypes) and the TensorRT plugins both use.
#   build_scripts/build_kernels.sh [OUT_DIR]     (default: build/)
# Env: NVCC (default nvcc), K3_CUDA_ARCHS (default "90a"), K3_COMPILE_ONLY=1 to stop after
# compiling objects (CI: catches build breaks without a GPU or a link step).
set -euo pipefail
here="$(cd "$(dirname "$0")/.." && pwd)"
out="${1:-$here/build}"
nvcc="${NVCC:-nvcc}"
archs="${K3_CUDA_ARCHS:-90a}"
mkdir -p "$out/obj"
gencode=()
for a in $archs; do gencode+=("-gencode" "arch=compute_${a},code=sm_${a}"); done
shopt -s nullglob
sources=("$here"/plugins/c_api/*.cu)
if [[ ${#sources[@]} -eq 0 ]]; then
  echo "no kernel sources in plugins/c_api/" >&2
  exit 1
fi
# One nvcc per source, all at once (each takes tens of seconds; a GPU host has the cores).
objs=() pids=()
for src in "${sources[@]}"; do
  obj="$out/obj/$(basename "${src%.cu}").o"
  "$nvcc" -std=c++17 -O3 -Xcompiler -fPIC --expt-relaxed-constexpr -lineinfo \
    "${gencode[@]}" -I"$here/plugins/include" -c "$src" -o "$obj" &
  objs+=("$obj") pids+=($!)
done
failed=0
for pid in "${pids[@]}"; do wait "$pid" || failed=1; done
if [[ $failed -ne 0 ]]; then
  echo "build_kernels.sh: a kernel source failed to compile (nvcc's messages above)" >&2
  exit 1
fi
if [[ "${K3_COMPILE_ONLY:-0}" == "1" ]]; then
  echo "compiled ${#objs[@]} kernel sources for sm_${archs// /, sm_}"
  exit 0
fi
"$nvcc" -shared -cudart static "${gencode[@]}" "${objs[@]}" -o "$out/libk3_kernels.so.tmp"
mv "$out/libk3_kernels.so.tmp" "$out/libk3_kernels.so"
echo "$out/libk3_kernels.so"
