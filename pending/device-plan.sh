#!/usr/bin/env bash
# Device plan for the two pending GPU changes (pending/README.md). Run on the device from a checkout
# of main with both patches applied, with main's own tree (git archive) unpacked under baseline/ for
# the same-run baseline:
#   git apply pending/bf16-matrix-warps.patch pending/nvfp4-early-prefetch.patch
#   mkdir -p baseline && git archive main | tar -x -C baseline
#   run(command="bash pending/device-plan.sh", kind="nvidia-h100-x1" or the H200, timeout_s=590)
# Then, if everything passes: MXQ_CHECK_SKIP="cpu-tests cli peers" bash scripts/device-check.sh.
set -uo pipefail
L=$OUT/log.txt; : > "$L"; mkdir -p "$OUT/logs"
say() { echo "[$SECONDS s] $*" | tee -a "$L"; }
conf() { cmake -S "$1" -B "$2" -G Ninja -DCMAKE_BUILD_TYPE=Release -DMXQ_ENABLE_CUDA=ON -DMXQ_CUDA_ARCHITECTURES=90a > "$OUT/logs/$3.log" 2>&1; }
say "$(nvidia-smi --query-gpu=name --format=csv,noheader)"
B=build-device
conf . $B build && timeout 360 cmake --build $B -j16 --target rotation_test cuda_bench quantize_test qdq_test >> "$OUT/logs/build.log" 2>&1 ||
  { say BUILD FAILED; grep -B5 -A20 -m3 'error' "$OUT/logs/build.log" | head -60; exit 1; }
say "build ok ($(grep -c 'spilled' "$OUT/logs/build.log") spill lines)"
T=$B/tests
$T/rotation_test --gtest_filter='*Bf16*:Cuda*' --gtest_brief=1 > "$OUT/logs/rot.log" 2>&1; say "rotation_test Cuda*/Bf16: rc=$? $(grep -E '^\[  (PASSED|FAILED|SKIPPED) |bf16 tensor-core' "$OUT/logs/rot.log" | tr '\n' ' ')"
grep -A15 -m3 Failure "$OUT/logs/rot.log" | head -50 | tee -a "$L"
$T/quantize_test --gtest_filter='*cuda*:Cuda*' --gtest_brief=1 > "$OUT/logs/q.log" 2>&1; say "quantize_test cuda: rc=$? $(grep -E '^\[  (PASSED|FAILED) ' "$OUT/logs/q.log" | tr '\n' ' ')"
$T/qdq_test --gtest_filter='*cuda*:Cuda*' --gtest_brief=1 > "$OUT/logs/qq.log" 2>&1; say "qdq_test cuda: rc=$? $(grep -E '^\[  (PASSED|FAILED) ' "$OUT/logs/qq.log" | tr '\n' ' ')"
nvcc -O2 -arch=sm_90a scripts/probes/bf16_mma_bound.cu -o "$B/bf16_mma_bound" > "$OUT/logs/probe-build.log" 2>&1 &&
  timeout 60 "$B/bf16_mma_bound" > "$OUT/bf16_mma_bound.txt" 2>&1; say "probe bf16_mma_bound: rc=$?"; cat "$OUT/bf16_mma_bound.txt" | tee -a "$L"
for w in 4 8; do  # (the test's fixture sets MXQ_CUDA_MATRIX_BF16_WARPS from its parameter)
  timeout 150 compute-sanitizer --tool racecheck --error-exitcode 9 $T/rotation_test --gtest_filter="Cuda/CudaRotationMatrixBf16.*/Warps$w" --gtest_brief=1 > "$OUT/logs/race$w.log" 2>&1
  say "racecheck bf16 warps $w: rc=$? $(grep 'RACECHECK SUMMARY' "$OUT/logs/race$w.log")"
done
for w in 4 8; do
  MXQ_CUDA_MATRIX_BF16_WARPS=$w timeout 90 $B/bench/cuda_bench --reps 30 --only 'bf16' > "$OUT/bench-bf16-w$w.txt" 2>&1; say "bench bf16 warps $w: rc=$?"
done
timeout 90 $B/bench/cuda_bench --reps 30 --only 'graph' > "$OUT/bench-graph-new.txt" 2>&1; say "bench graph (new): rc=$?"
# the same-run baseline: main's decode rows
conf baseline build-base base && timeout 240 cmake --build build-base -j16 --target cuda_bench >> "$OUT/logs/base.log" 2>&1 &&
  timeout 90 build-base/bench/cuda_bench --reps 30 --only 'graph' > "$OUT/bench-graph-main.txt" 2>&1; say "bench graph (main): rc=$?"
grep -h "graph" "$OUT"/bench-graph-*.txt | tee -a "$L"
grep -h "bf16" "$OUT"/bench-bf16-w*.txt | tee -a "$L"
say done
tar czf "$OUT/logs.tgz" -C "$OUT" logs && rm -rf "$OUT/logs"
