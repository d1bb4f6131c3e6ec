#!/usr/bin/env bash
# Next session: with pending/nvfp4-div6.patch, nvfp4-rot-push.patch, dequant-cvt.patch and
# nvfp4-finite-m.patch applied to main in the working tree (in that order), device-check's GPU suites and
# sanitizers on it, then three prebuilt cuda_bench binaries (sm_90a): new = main's GPU code (f8d9759),
# div6 = + nvfp4_scale_code_fast, all = + the NVFP4 push for rotated QDQ chunks + the rotated
# dequantize's hardware conversion + NVFP4 quantize's finite-multiplier codes (disjoint rows); the NVFP4, Hadamard and
# dequantize rows, one pass per call (a summary table at the end); then Nsight Compute raw metrics (pipes, stall
# reasons) of the quantize had128 kernels. Two calls (the first about 500 s cold):
#   run(command="bash build-cuda/exp/run6.sh", carry=["build-cuda/exp"], timeout_s=600)        # check + pass 1
#   run(command="SKIP_CHECK=1 PASSES=2 NCU=1 bash build-cuda/exp/run6.sh", carry=["build-cuda/exp"])  # warm: pass 2 + ncu
set -uo pipefail
[ "${SKIP_CHECK:-0}" = 1 ] || MXQ_CHECK_SKIP="cpu-tests cli peers python bench" bash scripts/device-check.sh | tail -8
cd build-cuda/exp
for v in new div6 all; do gunzip -c $v.gz > cuda_bench.$v && chmod +x cuda_bench.$v; done
nvidia-smi --query-gpu=name --format=csv,noheader
for pass in ${PASSES:-1}; do for v in new div6 all; do for o in nvfp4 "mxfp4 even, had" "mxfp4 even, swizzled, had" "dequantize"; do
  timeout 90 ./cuda_bench.$v --reps 30 --only "$o" > "cmp-$v-$pass-${o//[ ,]/_}.txt" 2>&1 || echo "$v $pass $o rc=$?"
done; done; done
[ "${NCU:-0}" = 1 ] && for row in "quantize mxfp4 even, swizzled, had128" "quantize nvfp4 given S, swizzled, had128" "qdq mxfp4 even, had128"; do
  timeout 90 ncu --clock-control none -k regex:block_kernel -s 2 -c 1 --section ComputeWorkloadAnalysis --section WarpStateStats \
    --section SpeedOfLight --section InstructionStats --page raw --csv ./cuda_bench.new --quick --reps 1 --only "$row" > "ncu-${row//[ ,]/_}.csv" 2>> ncu.err || echo "ncu $row rc=$?"
done
tar czf $OUT/run6.tgz cmp-*.txt $(ls ncu-*.csv ncu.err 2>/dev/null)
python3 - <<'PY'
import glob, re, collections
d = collections.defaultdict(dict)
for f in sorted(glob.glob('cmp-*.txt')):
    v, p = f.split('-')[1], f.split('-')[2]
    for line in open(f).read().splitlines()[2:]:
        parts = re.split(r'\s{2,}', line.strip())
        if len(parts) >= 7: d[tuple(parts[:4])].setdefault(v, []).append(float(parts[6].rstrip('%')))
for k, vs in d.items():
    print(f"{' '.join(k):70s}" + ''.join(f" {v}={sum(x)/len(x):5.1f}%" for v, x in vs.items()))
PY
