#!/usr/bin/env bash
# Session 20 (trimmed): issue 15's final table on whatever GPU comes: main at 87e8ae4 (prebuilt
# sm_90a cuda_bench): had rows with torch peers, matrix128 bf16 rows, ncu raw metrics of quantize had128.
set -uo pipefail
cd build-cuda/exp
gunzip -c new.gz > cuda_bench.new && chmod +x cuda_bench.new
nvidia-smi --query-gpu=name --format=csv,noheader
timeout 90 ./cuda_bench.new --reps 30 --only had --json $OUT/had.jsonl > $OUT/had.txt 2>&1; echo "had rc=$?"
timeout 40 ./cuda_bench.new --reps 30 --only "matrix128 bf16" > $OUT/matrix.txt 2>&1; echo "matrix rc=$?"
timeout 60 ncu --clock-control none -k regex:block_kernel -s 2 -c 1 --section ComputeWorkloadAnalysis --section WarpStateStats --section SpeedOfLight --page raw --csv \
  ./cuda_bench.new --quick --reps 1 --only "quantize mxfp4 even, swizzled, had128" > $OUT/ncu-raw.csv 2> ncu.err; echo "ncu rc=$?"; tail -2 ncu.err
timeout 100 python3 ../../bench/torch_peers.py $OUT/had.jsonl --markdown $OUT/peers.md > $OUT/peers.log 2>&1; echo "peers rc=$?"
cat $OUT/peers.md
