#!/usr/bin/env bash
# One call on the GPU machine: build from a bare checkout, run every test, write logs under $OUT,
# end with a short table. GPU tests and benchmarks join here as the CUDA backend lands (issue 3).
set -uo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
OUT=${OUT:-$ROOT/device-out}
mkdir -p "$OUT"
BUILD=$ROOT/build-device
status() { printf '%-28s %s\n' "$1" "$2" | tee -a "$OUT/summary.txt"; }
: > "$OUT/summary.txt"

{ nvidia-smi --query-gpu=name,compute_cap,driver_version,memory.total --format=csv,noheader; nvcc --version | tail -1; cmake --version | head -1; } > "$OUT/machine.txt" 2>&1

if cmake -S "$ROOT" -B "$BUILD" -G Ninja -DCMAKE_BUILD_TYPE=Release > "$OUT/configure.log" 2>&1 &&
   cmake --build "$BUILD" -j "$(nproc)" > "$OUT/build.log" 2>&1; then
  status build ok
else
  status build FAILED; tail -30 "$OUT/configure.log" "$OUT/build.log"; exit 1
fi
(cd "$BUILD" && ctest -j "$(nproc)" --output-on-failure > "$OUT/ctest.log" 2>&1)
status "ctest (CPU suites)" "$(grep -E 'tests passed' "$OUT/ctest.log" || echo FAILED)"
OMP_NUM_THREADS=$(nproc) "$BUILD/bench/cpu_bench" --quick > "$OUT/cpu_bench.txt" 2>&1
status "cpu_bench --quick" "see cpu_bench.txt"
echo; cat "$OUT/machine.txt"; echo; cat "$OUT/summary.txt"; echo; sed -n '1,8p' "$OUT/cpu_bench.txt"
