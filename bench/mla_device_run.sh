#!/usr/bin/env bash
# One call on the GPU machine: build mla.cu on its own (so a sibling kernel source being
# edited cannot break it) once per variant, run the CUDA tests, then the benchmark for each
# variant; logs and results in $OUT (FlashMLA's .so: carry [".carry/_flashmla_C.abi3.so"]).
#   bench/mla_device_run.sh [mla_bench.py args]    (no args: --issue21, every MLA row of issue
#                                                  21 with the peers -> $OUT/main/mla_issue21_h200.json)
#   MLA_VARIANTS="name:nvcc flags;name2:flags"  variants to build (default "main:", the
#                                               sources as they are); the first is the one
#                                               tested (MLA_TEST_ALL=1: every variant). mla.cu
#                                               reads no -D switch since session 18 (the old
#                                               ones are in git history, baada2a): flags are
#                                               nvcc options or a switch added to compare
#   MLA_PREBUILT="name:lib.so;name2:lib2.so"     libraries built beforehand (on the CPU machine
#                                               with this nvcc line): no device compile
#   MLA_TESTS=0                                 no tests (e.g. run_all.sh ran them already)
#   MLA_PYTEST_ARGS="-k fp8"                    extra pytest arguments (a subset of the tests)
#   MLA_BASELINE=path/to/libk3_kernels.so       a prebuilt library benchmarked as "baseline"
# Issue 21's MLA rows after tests/gpu/run_all.sh built and tested the library in the same call:
#   MLA_PREBUILT="main:build/libk3_kernels.so" MLA_TESTS=0 bench/mla_device_run.sh --issue21 --commit ID
set -uo pipefail
cd "$(dirname "$0")/.."
[[ $# -eq 0 ]] && set -- --issue21
out="${OUT:-/tmp/mla_out}"
mkdir -p "$out" /tmp/k3mla
export PYTHONPATH="$PWD" PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,temperature.gpu --format=csv,noheader

names=() libs=()
if [[ -n "${MLA_PREBUILT:-}" ]]; then
  IFS=';' read -ra prebuilt <<<"$MLA_PREBUILT"
  for spec in "${prebuilt[@]}"; do
    [[ -f "${spec#*:}" ]] || { echo "MLA_PREBUILT: no library ${spec#*:}"; exit 1; }
    names+=("${spec%%:*}")
    libs+=("$(realpath "${spec#*:}")")
  done
else
  IFS=';' read -ra variants <<<"${MLA_VARIANTS:-main:}"
  for spec in "${variants[@]}"; do
    name="${spec%%:*}" flags="${spec#*:}"
    names+=("$name")
    libs+=("/tmp/k3mla/libk3_mla_$name.so")
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
fi
echo "=== libraries ready ($SECONDS s)"

# A variant whose tests fail (or hang: pytest-timeout ends the process) is not benchmarked.
tested=()
if [[ "${MLA_TESTS:-1}" != "0" ]]; then
  tested=(0)
  [[ "${MLA_TEST_ALL:-0}" == "1" ]] && tested=("${!names[@]}")
fi
failed=" "
for i in "${tested[@]}"; do
  name="${names[$i]}"
  echo "=== tests: $name ($SECONDS s)" | tee -a "$out/test.log"
  # shellcheck disable=SC2086  # extra arguments are word-split on purpose
  K3_KERNELS_LIB="${libs[$i]}" timeout 150 python3 -m pytest tests/gpu/test_mla_cuda.py ${MLA_PYTEST_ARGS:-} \
    -q -rf --tb=short --timeout 40 --timeout-method thread 2>&1 | tee -a "$out/test.log" \
    | grep -E "passed|failed|rror" | tail -5
  [[ "${PIPESTATUS[0]}" == "0" ]] || failed+="$name "
done

runs=()
for i in "${!names[@]}"; do
  [[ "$failed" == *" ${names[$i]} "* ]] || runs+=("${names[$i]}:${libs[$i]}")
done
[[ -n "${MLA_BASELINE:-}" ]] && runs+=("baseline:$MLA_BASELINE")
for entry in "${runs[@]}"; do
  name="${entry%%:*}"
  echo "=== bench: $name ($SECONDS s)" | tee -a "$out/bench.log"
  K3_KERNELS_LIB="${entry#*:}" timeout 150 python3 bench/mla_bench.py --out "$out/$name" "$@" 2>&1 \
    | tee -a "$out/bench.log" | grep -vE "^(batch|tokens|context)="
done
echo "=== done ($SECONDS s)"
