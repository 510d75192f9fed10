#!/usr/bin/env bash
# One call on the GPU machine: build mla.cu on its own (so a sibling kernel source being
# edited cannot break it) once per variant, run the CUDA tests, then the benchmark for each
# variant; logs and results in $OUT (FlashMLA's .so in .carry/, so carry [".carry"]).
#   bench/mla_device_run.sh [mla_bench.py args]
#   MLA_VARIANTS="name:nvcc flags;name2:flags"  variants to build (default "main:", the
#                                               sources as they are); the first is the one
#                                               tested (MLA_TEST_ALL=1: every variant)
#   MLA_BASELINE=path/to/libk3_kernels.so       a prebuilt library benchmarked as "baseline"
set -uo pipefail
cd "$(dirname "$0")/.."
out="${OUT:-/tmp/mla_out}"
mkdir -p "$out" /tmp/k3mla
export PYTHONPATH="$PWD" PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,temperature.gpu --format=csv,noheader

IFS=';' read -ra variants <<<"${MLA_VARIANTS:-main:}"
names=()
for spec in "${variants[@]}"; do
  name="${spec%%:*}" flags="${spec#*:}"
  names+=("$name")
  # shellcheck disable=SC2086  # flags are word-split on purpose
  nvcc -std=c++17 -O3 -Xcompiler -fPIC --expt-relaxed-constexpr -lineinfo \
    -gencode arch=compute_90a,code=sm_90a -Iplugins/include -shared -cudart static \
    -Xptxas -v $flags plugins/c_api/mla.cu -o "/tmp/k3mla/libk3_mla_$name.so" \
    >"/tmp/k3mla/ptxas_$name.log" 2>&1 &
done
wait
for name in "${names[@]}"; do
  { echo "=== $name"; grep -B1 -A2 -E "latent_attention|flash_prefill|expand_latents" "/tmp/k3mla/ptxas_$name.log" \
      | grep -E "Compiling|registers|spill|error"; } >>"$out/ptxas.log"
  [[ -f "/tmp/k3mla/libk3_mla_$name.so" ]] || { cat "/tmp/k3mla/ptxas_$name.log"; exit 1; }
done

# A variant whose tests fail (or hang: pytest-timeout ends the process) is not benchmarked.
tested=("${names[0]}")
[[ "${MLA_TEST_ALL:-0}" == "1" ]] && tested=("${names[@]}")
failed=" "
for name in "${tested[@]}"; do
  echo "=== tests: $name ($SECONDS s)" | tee -a "$out/test.log"
  K3_KERNELS_LIB="/tmp/k3mla/libk3_mla_$name.so" timeout 150 python3 -m pytest tests/gpu/test_mla_cuda.py \
    -q -rf --tb=short --timeout 40 --timeout-method thread 2>&1 | tee -a "$out/test.log" \
    | grep -E "passed|failed|rror" | tail -5
  [[ "${PIPESTATUS[0]}" == "0" ]] || failed+="$name "
done

libs=()
for name in "${names[@]}"; do
  [[ "$failed" == *" $name "* ]] || libs+=("$name:/tmp/k3mla/libk3_mla_$name.so")
done
[[ -n "${MLA_BASELINE:-}" ]] && libs+=("baseline:$MLA_BASELINE")
for entry in "${libs[@]}"; do
  name="${entry%%:*}"
  echo "=== bench: $name ($SECONDS s)" | tee -a "$out/bench.log"
  K3_KERNELS_LIB="${entry#*:}" timeout 150 python3 bench/mla_bench.py --out "$out/$name" "$@" 2>&1 \
    | tee -a "$out/bench.log" | grep -vE "^(batch|tokens|context)="
done
