#!/usr/bin/env bash
# One call on the GPU machine for issue 22's kernel-written KDA snapshots: compile every kernel
# source at once, link kda.cu alone too (so a sibling source that does not build cannot stop the
# KDA tests), run the snapshot GPU tests, then the prefix-cache TTFT at K3 TP8-rank dims and the
# tiny model's bf16 exactness run with the full library; logs and the TTFT JSON in $OUT.
#   bench/prefix_cache_device_run.sh      (carry .carry: the K3 config)
set -uo pipefail
cd "$(dirname "$0")/.."
out="${OUT:-/tmp/prefix_out}" b=/tmp/k3pc
mkdir -p "$out" "$b"
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
start=$SECONDS
gen=(-gencode arch=compute_90a,code=sm_90a)
pids=() names=()
for src in plugins/c_api/*.cu; do
  n=$(basename "${src%.cu}")
  timeout 110 nvcc -std=c++17 -O3 -Xcompiler -fPIC --expt-relaxed-constexpr "${gen[@]}" -Iplugins/include \
    -c "$src" -o "$b/$n.o" 2>"$b/$n.log" &
  pids+=($!) names+=("$n")
done
full=1
for i in "${!pids[@]}"; do
  wait "${pids[$i]}" || { full=0; echo "${names[$i]}.cu did not build:"; tail -3 "$b/${names[$i]}.log"; }
done
nvcc -shared -cudart static "${gen[@]}" "$b/kda.o" -o "$b/libk3_kda.so" || exit 1
[ $full = 1 ] && nvcc -shared -cudart static "${gen[@]}" "$b"/*.o -o "$b/libk3_kernels.so"
echo "built in $((SECONDS - start)) s"
K3_KERNELS_LIB=$b/libk3_kda.so timeout 70 python3 -m pytest -q -s -p no:cacheprovider tests/gpu/test_kda_cuda.py \
  -k "snapshot or handoff" 2>&1 | tee "$out/kda_tests.log" | grep -E "rel err|snapshots|passed|failed|Error"
budget=${BUDGET_S:-118}  # the call's wall-clock share: every step below gets what is left
if [ -f "$b/libk3_kernels.so" ]; then
  K3_KERNELS_LIB=$b/libk3_kernels.so timeout $((budget - (SECONDS - start))) python3 bench/prefix_cache_ttft.py \
    --config .carry/k3/config.json --shapes 8:8 --out "$out/prefix_cache_ttft_h200.json" 2>&1 | tee "$out/ttft.log" | tail -5
  left=$((budget - (SECONDS - start)))
  if [ $left -gt 20 ]; then
    K3_KERNELS_LIB=$b/libk3_kernels.so timeout $left python3 bench/prefix_cache_exactness.py cuda bfloat16 2>&1 \
      | tee "$out/exactness.log" | tail -2
  fi
fi
echo "wall $((SECONDS - start)) s"
