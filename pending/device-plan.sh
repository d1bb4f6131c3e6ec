#!/usr/bin/env bash
# The device plan of pending/README.md: run through the device tool (timeout_s 480) on a branch with
# pending/gpu-matrix-rotation.patch and pending/multi-gpu-engine.patch applied; logs under $OUT.
set -uo pipefail
cd "$(dirname "$0")/.."
L=$OUT/log.txt; : > $L; mkdir -p $OUT/logs
say() { echo "[$SECONDS s] $*" | tee -a $L; }
left() { [ $SECONDS -lt $1 ]; }
B=build-device
say "$(nvidia-smi --query-gpu=name,driver_version --format=csv,noheader)"
(cd scripts/probes && nvcc -O2 -arch=sm_90a dmma_order.cu -o /tmp/p && /tmp/p) > $OUT/logs/probe.txt 2>&1; say "probe rc=$?"; cat $OUT/logs/probe.txt | head -30 | tee -a $L
cmake -S . -B $B -G Ninja -DCMAKE_BUILD_TYPE=Release -DMXQ_ENABLE_CUDA=ON -DMXQ_CUDA_ARCHITECTURES=90a > $OUT/logs/build.log 2>&1
timeout 360 cmake --build $B -j16 --target rotation_test quantize_test qdq_test cuda_bench checkpoint_test mxq_tool >> $OUT/logs/build.log 2>&1 || { say BUILD FAILED; grep -B5 -A20 -m3 'error' $OUT/logs/build.log | head -80; tail -20 $OUT/logs/build.log; tar czf $OUT/logs.tgz -C $OUT logs; exit 1; }
say "build ok; spills: $(grep -c 'spilled to local memory' $OUT/logs/build.log)"
# python extension in the background
PYV=$B/pyvenv
( python3 -m venv --system-site-packages $PYV && python3 -c 'import site; print("\n".join(site.getsitepackages()))' > "$($PYV/bin/python -c 'import site; print(site.getsitepackages()[0])')/mxq-parent-env.pth" && MXQ_LIBMXQ_BUILD_DIR=$PWD/$B MAX_JOBS=8 timeout 200 $PYV/bin/python -m pip install --no-build-isolation --no-deps --no-index -v . ) > $OUT/logs/pip.log 2>&1 &
PIP=$!
T=$B/tests
$T/rotation_test --gtest_filter='Rotation.SignedZeros*:Cuda*' --gtest_brief=1 > $OUT/logs/rot.log 2>&1; say "rotation_test Cuda*: rc=$? $(grep -E '^\[  (PASSED|FAILED) ' $OUT/logs/rot.log | tr '\n' ' ')"
grep -A12 -m4 Failure $OUT/logs/rot.log | head -60 | tee -a $L
$T/quantize_test --gtest_filter='StochasticOffsets.*' --gtest_brief=1 > $OUT/logs/sro.log 2>&1; say "StochasticOffsets: rc=$? $(grep -E '^\[  (PASSED|FAILED) ' $OUT/logs/sro.log | tr '\n' ' ')"
grep -A12 -m3 Failure $OUT/logs/sro.log | head -40 | tee -a $L
timeout 60 compute-sanitizer --tool memcheck --error-exitcode 9 $T/rotation_test --gtest_filter='Cuda/CudaRotationMatrix.Large*' --gtest_brief=1 > $OUT/logs/memcheck.log 2>&1; say "memcheck Large: rc=$? $(grep 'ERROR SUMMARY' $OUT/logs/memcheck.log)"
timeout 60 $B/bench/cuda_bench --reps 20 --only matrix > $OUT/logs/bench_matrix.txt 2>&1; say "bench matrix rc=$?"; cat $OUT/logs/bench_matrix.txt | tee -a $L
if left 300 && [ -n "${NCU:-}" ]; then
  timeout 100 ncu --clock-control none -k regex:'block_kernel' -s 2 -c 1 --section SourceCounters --page source --print-source sass --csv $B/bench/cuda_bench --quick --reps 1 --only 'quantize mxfp4 even, swizzled, had128' > $OUT/ncu-source.csv 2> $OUT/logs/ncu-source.err; say "ncu source rc=$? $(wc -l < $OUT/ncu-source.csv) lines"
  timeout 100 ncu --clock-control none -k regex:'block_kernel' -s 2 -c 1 --section SpeedOfLight --section Occupancy --section WarpStateStats --section LaunchStats --section InstructionStats $B/bench/cuda_bench --quick --reps 1 --only 'quantize mxfp4 even, swizzled, had128' > $OUT/ncu-had128.txt 2>&1; say "ncu sol rc=$?"
  timeout 80 $B/bench/cuda_bench --reps 30 --only had > $OUT/logs/bench_had.txt 2>&1; say "bench had rc=$?"; cat $OUT/logs/bench_had.txt >> $L
fi
timeout 90 $B/tools/mxq/checkpoint_test --gtest_filter='CheckpointDevice.*' --gtest_brief=1 > $OUT/logs/ckdev.log 2>&1; say "CheckpointDevice: rc=$? $(grep -E '^\[  (PASSED|FAILED|SKIPPED) ' $OUT/logs/ckdev.log | tr '\n' ' ')"
grep -A10 -m3 Failure $OUT/logs/ckdev.log | head -30 | tee -a $L
wait $PIP; say "pip rc=$?"; tail -5 $OUT/logs/pip.log >> $L
if left 380; then
  timeout $((440 - SECONDS)) $PYV/bin/python -m pytest tests/python/test_cuda.py -q -x -rs > $OUT/pytest.txt 2>&1; say "pytest test_cuda: rc=$? $(tail -1 $OUT/pytest.txt)"
  grep -E '^(FAILED|ERROR)' $OUT/pytest.txt | head | tee -a $L
fi
for t in quantize_test qdq_test; do
  left 420 || { say "skip $t (time)"; continue; }
  timeout $((470 - SECONDS)) $T/$t --gtest_filter='*cuda*:Cuda*' --gtest_brief=1 > $OUT/logs/g_$t.log 2>&1; say "$t cuda: rc=$? $(grep -E '^\[  (PASSED|FAILED) ' $OUT/logs/g_$t.log | tr '\n' ' ')"
  grep -A10 -m2 Failure $OUT/logs/g_$t.log | head -30 | tee -a $L
done
say done
tar czf $OUT/logs.tgz -C $OUT logs && rm -rf $OUT/logs
