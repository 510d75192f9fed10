#!/usr/bin/env bash
# On a GPU machine, one command: build the kernel library, then the rank-slice benchmark
# (bench/rank_slice.py) and/or its repeat check.
#   bench/rank_slice_device_run.sh [bench|repeat|both] [more rank_slice.py args]
# Env: K3_CONFIG (default: .carry/k3/config.json when carried, else ../shared/k3/config.json),
#      OUT (results folder, default bench/results), SKIP_BUILD=1 to reuse build/libk3_kernels.so.
set -euo pipefail
cd "$(dirname "$0")/.."
export PYTHONUNBUFFERED=1
mode="${1:-both}"
shift || true
out="${OUT:-bench/results}"
mkdir -p "$out"
config="${K3_CONFIG:-}"
if [[ -z "$config" ]]; then
  if [[ -f .carry/k3/config.json ]]; then config=.carry/k3/config.json; else config=../shared/k3/config.json; fi
fi
if [[ "${SKIP_BUILD:-0}" != "1" ]]; then
  start=$(date +%s)
  if ! build_scripts/build_kernels.sh build >"$out/rank_slice_build.log" 2>&1; then
    cat "$out/rank_slice_build.log" >&2
    exit 1
  fi
  echo "kernel library built in $(( $(date +%s) - start )) s"
fi
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,temperature.gpu,power.draw,memory.used --format=csv || true
case "$mode" in
  repeat|both)
    python3 bench/rank_slice.py --config "$config" --repeat-check --out "$out/rank_slice_repeat_h200.json" "$@" ;;
esac
case "$mode" in
  bench|both)
    python3 bench/rank_slice.py --config "$config" --out "$out/rank_slice_h200.json" "$@" ;;
  repeat) ;;
  *) echo "rank_slice_device_run.sh: mode '$mode': expected bench, repeat or both" >&2; exit 2 ;;
esac
