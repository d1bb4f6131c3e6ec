#!/usr/bin/env bash
# Session 21: the strengthened dequantize-edges test (prebuilt CUDA rotation_test at the working tree),
# the whole CudaRotation suite and memcheck of the new test; then, time permitting, ncu of the matrix mode.
set -uo pipefail
cd build-cuda/exp
gunzip -c rotation_test.gz > rotation_test && chmod +x rotation_test
nvidia-smi --query-gpu=name --format=csv,noheader
./rotation_test --gtest_filter='CudaRotation.*:Rotation.*' --gtest_brief=1 2>&1 | tail -4
compute-sanitizer --tool memcheck ./rotation_test --gtest_filter='CudaRotation.DequantizeRoundsAtTheEdges*' --gtest_brief=1 2>&1 | tail -3
gunzip -c new.gz > cuda_bench.new && chmod +x cuda_bench.new
timeout 70 ncu --clock-control none -k regex:matrix_quant_kernel -s 2 -c 1 --section SpeedOfLight --section WarpStateStats \
    --section Occupancy --section LaunchStats --section ComputeWorkloadAnalysis --page raw --csv ./cuda_bench.new --quick --reps 1 \
    --only "qdq mxfp4 even, matrix128 bf16" > $OUT/ncu-matrix.csv 2> $OUT/ncu.err; echo "ncu rc=$?"
