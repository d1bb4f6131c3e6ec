#!/usr/bin/env bash
# Device plan for the pending GPU changes (pending/README.md). Two calls on one warm machine, from a
# checkout of main with both patches applied and main's own tree unpacked under baseline/:
#   git apply pending/small-qdq-chunks.patch pending/rto-pairs.patch
#   mkdir -p baseline && git archive main | tar -x -C baseline
#   run(command="bash pending/device-plan.sh check", kind="nvidia-h100-x1", timeout_s=400)   # ~180 s
#   run(command="bash pending/device-plan.sh bench", timeout_s=400)  # at once, while warm  # ~200 s
# (A cold second call rebuilds build-device first: about 100 s more.)
set -uo pipefail
B=build-device
case "${1:-}" in
check)
  # build, the GPU suites (the QDQ and rotation suites twice: the rule's widths and MXQ_CUDA_QDQ_CHUNK=16; memcheck at both),
  # memcheck / racecheck / synccheck / initcheck
  MXQ_CHECK_SKIP="cpu-tests cli peers python bench" bash scripts/device-check.sh 2>&1 | tail -12
  # the rule's other width forced everywhere: every small and large QDQ case at 8-element chunks
  for t in qdq_test rotation_test; do
    MXQ_CUDA_QDQ_CHUNK=8 $B/tests/$t --gtest_filter='*cuda*:Cuda*' --gtest_brief=1 > $OUT/$t-c8.log 2>&1
    echo "$t MXQ_CUDA_QDQ_CHUNK=8: rc=$? $(grep -E '^\[  (PASSED|FAILED) ' $OUT/$t-c8.log | tr '\n' ' ')"
    grep -m2 -A12 Failure $OUT/$t-c8.log | head -30
  done
  ;;
bench)
  [ -x $B/bench/cuda_bench ] || { cmake -S . -B $B -G Ninja -DCMAKE_BUILD_TYPE=Release -DMXQ_ENABLE_CUDA=ON -DMXQ_CUDA_ARCHITECTURES=90a > $OUT/conf.log 2>&1 && cmake --build $B -j16 --target cuda_bench > $OUT/build.log 2>&1; }
  cmake -S baseline -B build-base -G Ninja -DCMAKE_BUILD_TYPE=Release -DMXQ_ENABLE_CUDA=ON -DMXQ_CUDA_ARCHITECTURES=90a > $OUT/base-conf.log 2>&1
  timeout 200 cmake --build build-base -j16 --target cuda_bench > $OUT/base-build.log 2>&1 || tail -20 $OUT/base-build.log
  for r in 1 2; do
    for t in new main; do
      bin=$B/bench/cuda_bench; [ $t = main ] && bin=build-base/bench/cuda_bench
      for rows in had graph; do
        timeout 90 $bin --reps 30 --only "$rows" >> $OUT/bench-$t-$r.txt 2>&1
      done
    done
  done
  for f in $OUT/bench-*.txt; do echo "== $(basename $f)"; grep -E "^(qdq|quantize|dequantize|copy|GPU)" $f; done
  ;;
*) echo "usage: device-plan.sh check|bench"; exit 2 ;;
esac
