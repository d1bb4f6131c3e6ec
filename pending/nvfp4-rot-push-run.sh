#!/usr/bin/env bash
# Session 20: device-check (GPU suites, sanitizers) of the checked-out tree (e2m1-pack2 with the
# NVFP4 push for rotated chunks only), then cuda_bench against main's prebuilt (main.gz, b54ba71).
set -uo pipefail
MXQ_CHECK_SKIP="cpu-tests cli peers python bench" bash scripts/device-check.sh | tail -8
cd build-cuda/exp && gunzip -c main.gz > cuda_bench.main && chmod +x cuda_bench.main
NEW=../../build-device/bench/cuda_bench
[ -x $NEW ] || { echo "no build"; exit 1; }
for pass in 1 2; do
  for v in main new; do
    b=./cuda_bench.main; [ $v = new ] && b=$NEW
    timeout 60 $b --reps 30 --only "qdq nvfp4" > "cmp-$v-$pass.txt" 2>&1; echo "$v $pass rc=$?"
  done
done
tar czf $OUT/cmp.tgz cmp-*.txt
