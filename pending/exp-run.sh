#!/usr/bin/env bash
# Prebuilt experiment (session 19, 2026-12-06): cuda_bench (sm_90a) of
#   main: main's GPU code (b54ba71);
#   var:  + the rotated static-choice block_kernel at 16-element chunks compiled for 4 blocks per SM
#         (branch rot-4-blocks); var3 = var capped at 3 blocks per SM (MXQ_CUDA_BLOCKS_PER_SM=3);
#   var2: main + element codes by e2m1_push (branch e2m1-pack): MXFP4 quantize of fp32 chunks (rotated,
#         matrix-rotated, fp32/fp16 input); every NVFP4 quantize (RNE) and the NVFP4 QDQ lookup path.
# Run: run(command="bash build-cuda/exp/run.sh", carry=["build-cuda/exp"], timeout_s=360)
set -uo pipefail
cd build-cuda/exp
for v in main var var2; do gunzip -c $v.gz > cuda_bench.$v && chmod +x cuda_bench.$v; done
nvidia-smi --query-gpu=name --format=csv,noheader
for v in main var var2; do timeout 100 ./cuda_bench.$v --reps 30 --only had > $OUT/bench-$v-1.txt 2>&1; echo "$v 1 rc=$?"; done
for v in main var var3 var2; do
  b=./cuda_bench.${v%3}; [ $v = var3 ] && export MXQ_CUDA_BLOCKS_PER_SM=3
  timeout 60 $b --reps 30 --only "swizzled, had" > $OUT/bench-$v-2.txt 2>&1; echo "$v 2 rc=$?"
  unset MXQ_CUDA_BLOCKS_PER_SM
done
for v in main var2; do timeout 60 ./cuda_bench.$v --reps 30 --only "quantize mxfp4 even, swizzled, matrix" > $OUT/bench-$v-3.txt 2>&1; echo "$v 3 rc=$?"; done
for v in main var2; do timeout 90 ./cuda_bench.$v --reps 30 --only nvfp4 > $OUT/bench-$v-4.txt 2>&1; echo "$v 4 rc=$?"; done
for v in main var var2; do
  c="quantize mxfp4 even, swizzled, had128"
  timeout 60 ncu --clock-control none -k regex:block_kernel -s 2 -c 1 --section SpeedOfLight --section Occupancy --section WarpStateStats --section InstructionStats --section LaunchStats \
    ./cuda_bench.$v --quick --reps 1 --only "$c" > "$OUT/ncu-$v.txt" 2>&1
  echo "== ncu $v: $c"; grep -E 'Duration|DRAM Throughput|Compute \(SM\) Throughput|Registers Per|Achieved Occupancy|Theoretical Occupancy|Issue Slots Busy|Executed Instructions  |Local' "$OUT/ncu-$v.txt" | head -12
done
