#!/usr/bin/env bash
# One call on the GPU machine: build kda.cu on its own (so a sibling kernel source being
# edited cannot break it), run the CUDA tests, then the benchmark; logs and results in $OUT.
#   [KDA_VARIANTS="name:-DFLAG[,-DFLAG2] ..."] [KDA_PREFILL_VARIANTS=...] [KDA_DECODE_VARIANTS=...]
#   bench/kda_device_run.sh [kda_bench.py args]
# (kda.cu and its headers read no -D switch since session 18: a variant's flags are nvcc options
# or a switch added to the tree for that comparison; the old ones are in git history, baada2a)
# FLA wheel in .whl/, FlashKDA in .carry/. Each variant is built in parallel with the main
# library (they build while the tests run) and benchmarked after the main run:
# KDA_PREFILL_VARIANTS all in one kda_prefill_variants.py process next to the main build
# "tree" (args: KDA_PREFILL_ARGS, e.g. --flashkda PATH; $OUT/kda_prefill_variants.json), then
# KDA_DECODE_VARIANTS likewise in kda_decode_bench.py (args: KDA_DECODE_ARGS, e.g. --fla;
# $OUT/kda_decode.json), then KDA_VARIANTS one kda_bench.py process each, ours only
# ($OUT/<name>.json). KDA_TEST_TIMEOUT=0 skips the tests, KDA_MAIN_BENCH=0 the main
# kda_bench.py run.
# Every KDA row of issue 21 in one call (prefill T4096/T16384/varlen 64x256 at 96 heads, 1x16384
# and varlen 16x1024 at 12 heads; decode B 1/64/256) next to FlashKDA and FLA, one JSON
# ($OUT/kda_h200.json, commit id + GPU name) in <= 120 s: prebuild the library here first,
#   KDA_PREBUILD=1 bench/kda_device_run.sh      (nvcc here; writes .carry/kda/libk3_kda.so, its
#                                                 sources' hash and the commit id, for the JSON)
# then on the GPU machine (carry .carry/kda, .carry/_flashkda_C.abi3.so and .whl):
#   KDA_TEST_TIMEOUT=0 bench/kda_device_run.sh
# The prebuilt library is used when its recorded source hash is the tree's, else kda.cu is built
# there (~25-60 s). FLA's numbers go last: none starts later than KDA_DEADLINE_S (default 105)
# seconds after the script's start, and kda_bench.py is stopped 13 s after that
# (KDA_BENCH_TIMEOUT overrides), so that the call ends in time whatever FLA's autotuning costs.
set -uo pipefail
cd "$(dirname "$0")/.."
out="${OUT:-/tmp/kda_out}"
mkdir -p "$out" /tmp/k3kda
start=$(date +%s)
build() {  # build LIB [nvcc flags]
  local lib=$1
  shift
  timeout 150 nvcc -std=c++17 -O3 -Xcompiler -fPIC --expt-relaxed-constexpr -lineinfo \
    -gencode arch=compute_90a,code=sm_90a -Iplugins/include -shared -cudart static \
    -Xptxas -v "$@" plugins/c_api/kda.cu -o "$lib"
}
sources_sha() {  # everything kda.cu compiles from
  cat plugins/c_api/kda.cu plugins/include/k3/kda_api.h plugins/include/k3/params.h \
    plugins/include/k3/kda/*.cuh plugins/include/k3/common/*.cuh | sha256sum | cut -c1-16
}
prebuilt=.carry/kda/libk3_kda.so
if [ "${KDA_PREBUILD:-0}" = 1 ]; then
  mkdir -p .carry/kda
  build "$prebuilt.tmp" 2>/tmp/k3kda/ptxas_prebuild.log || { tail -20 /tmp/k3kda/ptxas_prebuild.log; exit 1; }
  mv "$prebuilt.tmp" "$prebuilt" && sources_sha >"$prebuilt.sha" && echo "$prebuilt ($(cat "$prebuilt.sha"))"
  # the GPU machine's copy of the tree may have no git metadata: the commit goes with the library
  { git rev-parse HEAD && git diff --quiet HEAD || echo "+uncommitted"; } 2>/dev/null | paste -sd '' >.carry/kda/commit
  exit 0
fi
[ -z "${K3_COMMIT:-}" ] && [ -f .carry/kda/commit ] && export K3_COMMIT="$(cat .carry/kda/commit)"
if ls .whl/fla_core-*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/fla_core-*.whl && export PYTHONPATH=/tmp/site
fi
lib=/tmp/k3kda/libk3_kda.so
if [ -f "$prebuilt" ] && [ "$(cat "$prebuilt.sha" 2>/dev/null)" = "$(sources_sha)" ]; then
  cp "$prebuilt" "$lib" && echo "prebuilt $prebuilt (sources $(cat "$prebuilt.sha"))"
  true &
else
  build "$lib" 2>"$out/ptxas.log" &
fi
main_build=$!
for v in ${KDA_VARIANTS:-} ${KDA_PREFILL_VARIANTS:-} ${KDA_DECODE_VARIANTS:-}; do
  flags="${v#*:}"
  build "/tmp/k3kda/lib_${v%%:*}.so" ${flags//,/ } 2>"/tmp/k3kda/ptxas_${v%%:*}.log" &
done
wait "$main_build" || { cat "$out/ptxas.log"; exit 1; }
export K3_KERNELS_LIB="$lib" PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,temperature.gpu --format=csv,noheader
if [ "${KDA_TEST_TIMEOUT:-150}" != 0 ]; then
  timeout "${KDA_TEST_TIMEOUT:-150}" python3 -m pytest tests/gpu/test_kda_cuda.py -q -s -rA 2>&1 | tee "$out/test.log" | grep -E "rel err|passed|failed|PASS|FAIL|Error|error"
fi
wait  # the variant builds ran during the tests
if [ "${KDA_MAIN_BENCH:-1}" != 0 ]; then
  left=$(( ${KDA_DEADLINE_S:-105} - ($(date +%s) - start) ))
  # the JSON is rewritten after every row: a kill at the timeout loses only the FLA number in flight
  timeout "${KDA_BENCH_TIMEOUT:-$(( left + 13 ))}" python3 bench/kda_bench.py --out "$out" --deadline-s "$left" "$@" 2>&1 |
    tee "$out/bench.log" | grep -vE "^\{"
  echo "kda_bench.py done $(( $(date +%s) - start )) s after the start"
fi
libs() {  # --lib arguments: the main build, then every built variant of the list
  echo "--lib tree=$lib"
  for v in "$@"; do
    [ -f "/tmp/k3kda/lib_${v%%:*}.so" ] && echo "--lib ${v%%:*}=/tmp/k3kda/lib_${v%%:*}.so" ||
      { echo "variant ${v%%:*}: build failed" >&2; tail -5 "/tmp/k3kda/ptxas_${v%%:*}.log" >&2; }
  done
}
if [ -n "${KDA_PREFILL_VARIANTS:-}" ]; then
  timeout "${KDA_PREFILL_TIMEOUT:-120}" python3 bench/kda_prefill_variants.py --out "$out" \
    $(libs ${KDA_PREFILL_VARIANTS}) ${KDA_PREFILL_ARGS:-} 2>&1 | tee "$out/prefill_variants.log" | grep -vE "^\{"
fi
if [ -n "${KDA_DECODE_VARIANTS:-}" ]; then
  timeout "${KDA_DECODE_TIMEOUT:-120}" python3 bench/kda_decode_bench.py --out "$out" \
    $(libs ${KDA_DECODE_VARIANTS}) ${KDA_DECODE_ARGS:-} 2>&1 | tee "$out/decode_variants.log" | grep -vE "^\{"
fi
for v in ${KDA_VARIANTS:-}; do
  name="${v%%:*}"
  [ -f "/tmp/k3kda/lib_$name.so" ] || { echo "variant $name: build failed"; tail -5 "/tmp/k3kda/ptxas_$name.log"; continue; }
  echo "== variant $name (${v#*:})"
  K3_KERNELS_LIB="/tmp/k3kda/lib_$name.so" timeout "${KDA_VARIANT_TIMEOUT:-120}" python3 bench/kda_bench.py --out "/tmp/k3kda/out_$name" \
    "$@" --no-fla --flashkda /nonexistent 2>&1 | grep -vE "^\{|Traceback|^  |Error"
  cp "/tmp/k3kda/out_$name/kda_h200.json" "$out/$name.json" 2>/dev/null
done
