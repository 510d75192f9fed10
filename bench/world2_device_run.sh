#!/usr/bin/env bash
# Issue 19 in one call on the two-GPU kind (nvidia-h200-x2): build the kernel library, then
# bench/world2.py's three checks (greedy tokens world 2 vs 1, the rank slice split over the two
# GPUs with NCCL, a rank killed mid-run); JSON and logs in $OUT. Carry [".carry"] (the K3 config).
#   bench/world2_device_run.sh [--layers N]   (passed to the slice check)
set -uo pipefail
cd "$(dirname "$0")/.."
out="${OUT:-/tmp/world2_out}"
mkdir -p "$out" build
# NVLink multicast stays off (the device docs): for this shell and every rank it starts
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export PYTHONPATH="$PWD" PYTHONUNBUFFERED=1 K3_KERNELS_LIB="$PWD/build/libk3_kernels.so"
nvidia-smi --query-gpu=index,name,clocks.sm,clocks.mem --format=csv,noheader | tee "$out/gpus.txt"
timeout 200 build_scripts/build_kernels.sh build >"$out/build.log" 2>&1 || { tail -20 "$out/build.log"; exit 1; }
status=0
timeout 240 python3 bench/world2.py tokens --device cuda --out "$out/world2_tokens.json" 2>&1 | tee "$out/tokens.log" || status=1
timeout 300 python3 bench/world2.py slice --device cuda --config .carry/k3/config.json --tp 8 --ep 8 "$@" \
  --out "$out/world2_slice.json" 2>&1 | grep -v "^USDT" | tee "$out/slice.log" || status=1
timeout 120 python3 bench/world2.py kill --device cuda --out "$out/world2_kill.json" 2>&1 | tee "$out/kill.log" || status=1
exit "$status"
