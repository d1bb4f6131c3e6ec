#!/usr/bin/env bash
# Run on a GPU host: build from a bare checkout, run every CPU and GPU test, the sanitizers
# and the benchmarks, write logs under $OUT, end with a short table.
#   MXQ_DEVICE_ARCH   CUDA architectures to build here (default: 90a, the H200; CI builds 80;89;90a)
#   MXQ_CHECK_SKIP    space-separated stages to skip: cpu-tests gpu-tests cli sanitizer bench peers python
#                     pytest (python without its tests: the package is still installed)
#   MXQ_CHECK_E2E     bench/generate_bench.py models to run after the package is installed (end-to-end
#                     tokens/s, e.g. "llama-1.3b qwen3-moe"); tables into $OUT/e2e-<model>.md
#   MXQ_CHECK_E2E_ARGS  extra generate_bench.py arguments, e.g. "--only mxq mxq-fused bf16-mxq-norm-silu --rounds 3";
#                     packed weights: "--only mxq-linear-mxfp4 mxq-linear-nvfp4" (llama-8b), and on an MoE model
#                     (qwen3-moe) "--only mxq-linear-moe-mxfp4 mxq-linear-moe-nvfp4" (experts on mxq.moe too; these
#                     names exist for MoE models only); issue targets below each table
#   MXQ_CHECK_PYTEST  the pytest targets (default tests/python)
#   MXQ_CHECK_GPU_TESTS  the GPU suites (default: every op's test and cuda_test, linear_test)
#   MXQ_CHECK_SANITIZE_TESTS  the suites run under compute-sanitizer (default: the GPU suites)
#   MXQ_CHECK_SANITIZE_FILTER  the gtest filter run under them (default: a representative subset)
#   MXQ_CHECK_SANITIZERS  the compute-sanitizer tools (default: memcheck racecheck synccheck initcheck)
#   MXQ_CHECK_LINEAR  linear_bench arguments (e.g. "--quick"): the W4A16 GEMM against cuBLAS, into $OUT/linear_bench.txt
#   MXQ_CHECK_LINEAR_PEERS  bench/linear_peers.py arguments (e.g. "--quick"): mxq.linear against cuBLAS and
#                     Humming, into $OUT/linear_peers.md; Humming from humming-kernels wheels in .whl/
#                     (installed with --no-index), else that column says why it is missing
#   MXQ_CHECK_MOE_PEERS  bench/moe_peers.py arguments (e.g. "--quick"): mxq.moe against bf16 grouped GEMM,
#                     Humming's MoE GEMM and triton_kernels matmul_ogs (if importable), into $OUT/moe_peers.md
#                     (rows also in $OUT/moe_peers.jsonl); Humming from .whl/ as for MXQ_CHECK_LINEAR_PEERS
#   MXQ_CHECK_E2E_PROFILE  models whose prefill is profiled per variant (torch.profiler) into $OUT
#   MXQ_CHECK_NCU     ';'-separated cuda_bench rows to profile with Nsight Compute (summary lines printed);
#                     'ROW@REGEX' profiles the kernel matching REGEX (default block_kernel / dequant_kernel)
#   MXQ_CHECK_NCU_SOURCE  one cuda_bench row: per-instruction SASS counts into $OUT/ncu-source.csv
#   MXQ_CHECK_CKPT_GB  checkpoint conversion benchmark (bench/checkpoint_bench.py) on a synthetic
#                     checkpoint of this many GB, mxfp4 and nvfp4 on cpu and cuda
set -uo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
OUT=${OUT:-$ROOT/device-out}
mkdir -p "$OUT"
BUILD=$ROOT/build-device
LOG=$OUT/logs  # packed into $OUT/logs.tgz at the end (one file to copy back)
mkdir -p "$LOG"
SKIP=" ${MXQ_CHECK_SKIP:-} "
JOBS=$(nproc)
status() { printf '%-34s %s\n' "$1" "$2" | tee -a "$OUT/summary.txt"; }
skipped() { [[ "$SKIP" == *" $1 "* ]]; }
: > "$OUT/summary.txt"

{ nvidia-smi --query-gpu=name,compute_cap,driver_version,memory.total --format=csv,noheader; nvcc --version | tail -1; cmake --version | head -1; } > "$LOG/machine.txt" 2>&1

t0=$SECONDS
if cmake -S "$ROOT" -B "$BUILD" -G Ninja -DCMAKE_BUILD_TYPE=Release -DMXQ_ENABLE_CUDA=ON \
     -DMXQ_CUDA_ARCHITECTURES="${MXQ_DEVICE_ARCH:-90a}" > "$LOG/configure.log" 2>&1 &&
   cmake --build "$BUILD" -j "$JOBS" > "$LOG/build.log" 2>&1; then
  status build "ok ($((SECONDS - t0)) s; $(grep -c 'spilled to local memory' "$LOG/build.log") kernels spill registers)"
else
  status build FAILED; tail -40 "$LOG/configure.log" "$LOG/build.log"; exit 1
fi

if ! skipped cpu-tests; then
  (cd "$BUILD" && ctest -j "$JOBS" -E 'Cuda|/cuda' --output-on-failure > "$LOG/ctest-cpu.log" 2>&1)
  status "ctest, CPU suites" "$(grep -E 'tests passed' "$LOG/ctest-cpu.log" || echo FAILED)"
fi

# The GPU suites: every op test's CUDA cases (named <op>/<backend>_...) and the CUDA-only tests.
GPU_TESTS=${MXQ_CHECK_GPU_TESTS:-"quantize_test dequantize_test qdq_test layout_test fused_test rotation_test cuda_test linear_test known_answer_test"}
GPU_FILTER='*cuda*:*Cuda*'
if ! skipped gpu-tests; then
  t0=$SECONDS; passed=0; failed=0; rc=0
  # run_suite TEST LOGNAME [ENV=VALUE...]: one suite's CUDA cases; adds to passed/failed/rc
  run_suite() {
    local t=$1 log=$LOG/$2.log; shift 2
    env "$@" "$BUILD/tests/$t" --gtest_filter="$GPU_FILTER" --gtest_brief=1 > "$log" 2>&1 || rc=1
    passed=$((passed + $(grep -oE '^\[  PASSED  \] [0-9]+' "$log" | grep -oE '[0-9]+$' || echo 0)))
    failed=$((failed + $(grep -cE '^\[  FAILED  \] .* \([0-9]+ ms\)$' "$log")))  # --gtest_brief: one line per failed test
    grep -q 'Failure' "$log" && grep -B2 -A12 'Failure' "$log" | head -40
  }
  for t in $GPU_TESTS; do run_suite $t $t; done
  # Small QDQ launches take 8-element chunks (small_qdq_plan): the QDQ suites again with the plan's
  # 16-element chunks forced, so the small cases cover both widths.
  for t in qdq_test rotation_test; do [[ " $GPU_TESTS " == *" $t "* ]] && run_suite $t $t-c16 MXQ_CUDA_QDQ_CHUNK=16; done
  status "GPU suites (CUDA vs reference)" "$passed passed, $failed failed rc=$rc ($((SECONDS - t0)) s; qdq and rotation, where run, twice)"
fi

if ! skipped cli && [ -x "$BUILD/tools/mxq/mxq" ]; then  # the tool's self-test on this GPU
  "$BUILD/tools/mxq/mxq" verify > "$LOG/mxq_verify.txt" 2>&1
  rc=$?
  status "mxq verify (cpu + cuda self-test)" "$(grep -E '^self-test cuda' "$LOG/mxq_verify.txt" | head -1) rc=$rc"
  [ $rc -ne 0 ] && tail -20 "$LOG/mxq_verify.txt"
  t0=$SECONDS
  "$BUILD/tools/mxq/mxq" demo --device cuda > "$OUT/mxq_demo.txt" 2>&1
  status "mxq demo --device cuda" "rc=$? ($((SECONDS - t0)) s, mxq_demo.txt)"
  "$BUILD/tools/mxq/mxq" bench --shape 8192x8192 --shape 16x8192 --no-reference --reps 20 > "$OUT/mxq_bench.txt" 2>&1
  status "mxq bench (cpu + cuda)" "rc=$? (mxq_bench.txt)"
  "$BUILD/tools/mxq/mxq" bench --op moe --shape 2880x2880 --experts 128:4 --tokens 1 --tokens 16 --format mxfp4 \
    --format nvfp4 --no-reference --reps 20 >> "$OUT/mxq_bench.txt" 2>&1
  status "mxq bench --op moe (cuda)" "rc=$? (mxq_bench.txt)"
  "$BUILD/tools/mxq/checkpoint_test" --gtest_filter='CheckpointDevice.*' --gtest_brief=1 > "$LOG/checkpoint_device.log" 2>&1
  rc=$?
  status "checkpoint: GPU == CPU bytes" "$(grep -E '^\[  (PASSED|SKIPPED|FAILED)  \]' "$LOG/checkpoint_device.log" | tr '\n' ' ') rc=$rc"
  [ $rc -ne 0 ] && grep -A8 'Failure' "$LOG/checkpoint_device.log" | head -30
fi

if ! skipped sanitizer; then
  # A representative subset (every kernel: both chunk widths, shuffles up to 32 lanes, atomics,
  # the fused amax, swizzle, graph capture); the full grid is too slow under the tools.
  #   (MXQ_CHECK_SANITIZE_FILTER replaces it.)
  FILTER=${MXQ_CHECK_SANITIZE_FILTER:-'*cuda_mxfp4_quest_rne_g16:*cuda_mxfp4_quest_stochastic_g256:*cuda_mxint8_floor_rne_g2:*cuda_nvfp4_nvfp4_rne:*cuda_mxfp6_e3m2_rceil_rne_g4:*Layout*cuda:*DequantizeBytes*cuda:CudaGraph*:*Fused*cuda_rms_norm:CudaRotation.SpecialValuesAndInPlace:LinearCuda.RowStride*:LinearCuda.Dequantize*:LinearCuda.EveryKernelKindOnce:LinearCuda.MmaTiles*:MoeCuda.*:*StochasticRoundingBytes/cuda*:*SwizzleLayoutBytes/cuda*'}
  for tool in ${MXQ_CHECK_SANITIZERS:-memcheck racecheck synccheck initcheck}; do
    errors=0; rc=0
    # sanitize TEST LOGNAME [ENV=VALUE...]: one suite's subset under the tool; adds to errors/rc
    sanitize() {
      local t=$1 log=$LOG/sanitizer-$tool-$2.log n; shift 2
      env "$@" compute-sanitizer --tool $tool --error-exitcode 9 "$BUILD/tests/$t" --gtest_filter="$FILTER" --gtest_brief=1 > "$log" 2>&1 || rc=$?
      n=$(grep -oE 'ERROR SUMMARY: [0-9]+' "$log" | grep -oE '[0-9]+$' || echo 0)
      errors=$((errors + ${n:-0}))
      [ "${n:-0}" != 0 ] && grep -m 3 -A 12 -E '^========= (Invalid|Race|Barrier|Uninitialized|Program hit|Error)' "$log"
    }
    for t in ${MXQ_CHECK_SANITIZE_TESTS:-$GPU_TESTS}; do sanitize $t $t; done
    if [ $tool = memcheck ]; then  # small QDQ cases at the 16-element chunks the rule passes over
      for t in qdq_test rotation_test; do [[ " ${MXQ_CHECK_SANITIZE_TESTS:-$GPU_TESTS} " == *" $t "* ]] && sanitize $t $t-c16 MXQ_CUDA_QDQ_CHUNK=16; done
    fi
    status "compute-sanitizer $tool" "ERROR SUMMARY: $errors errors over ${MXQ_CHECK_SANITIZE_TESTS:-$GPU_TESTS} rc=$rc"
  done
fi

if ! skipped bench; then
  "$BUILD/bench/cuda_bench" --json "$OUT/cuda_bench.jsonl" > "$LOG/cuda_bench.txt" 2>&1
  status "cuda_bench" "rc=$? (cuda_bench.txt)"
  OMP_NUM_THREADS=$JOBS "$BUILD/bench/cpu_bench" --quick > "$LOG/cpu_bench.txt" 2>&1
  status "cpu_bench --quick" "rc=$? (cpu_bench.txt)"
fi

if [ -n "${MXQ_CHECK_LINEAR:-}" ]; then  # the W4A16 linear against cuBLAS
  "$BUILD/bench/linear_bench" $MXQ_CHECK_LINEAR > "$OUT/linear_bench.txt" 2>&1
  status "linear_bench $MXQ_CHECK_LINEAR" "rc=$? (linear_bench.txt)"
fi

if [ -n "${MXQ_CHECK_NCU:-}" ]; then  # optional: Nsight Compute on chosen benchmark rows (';'-separated)
  IFS=';' read -ra CASES <<< "$MXQ_CHECK_NCU"
  for c in "${CASES[@]}"; do
    kern='block_kernel'; [[ "$c" == dequantize* ]] && kern='dequant_kernel'
    if [[ "$c" == *@* ]]; then kern=${c#*@}; c=${c%@*}; fi  # "row@kernel regex": another kernel of the row
    ncu --clock-control none -k regex:"$kern" -s 2 -c 1 --section SpeedOfLight --section Occupancy \
      --section WarpStateStats --section ComputeWorkloadAnalysis --section MemoryWorkloadAnalysis --section InstructionStats \
      --metrics dram__bytes_read.sum,dram__bytes_write.sum,lts__t_sectors_op_write.sum,lts__t_sectors_op_read.sum \
      "$BUILD/bench/cuda_bench" --quick --reps 1 --only "$c" > "$LOG/ncu-${c// /_}.txt" 2>&1
    echo "== ncu: $c"; grep -E 'Duration|Memory Throughput|DRAM Throughput|Compute \(SM\) Throughput|Registers Per|Achieved Occupancy|Theoretical Occupancy|Executed Ipc A|Issue Slots Busy|Executed Instructions  |Stall|Local|dram__bytes|lts__t_sectors|Hit Rate|Mem Busy' "$LOG/ncu-${c// /_}.txt" | head -32
  done
fi

if [ -n "${MXQ_CHECK_NCU_SOURCE:-}" ]; then  # optional: per-instruction SASS counts of one benchmark row
  ncu --clock-control none -k regex:'block_kernel' -s 2 -c 1 --section SourceCounters --page source --print-source sass --csv \
    "$BUILD/bench/cuda_bench" --quick --reps 1 --only "$MXQ_CHECK_NCU_SOURCE" > "$OUT/ncu-source.csv" 2> "$LOG/ncu-source.err"
  echo "== ncu source ($MXQ_CHECK_NCU_SOURCE): $(wc -l < "$OUT/ncu-source.csv") lines in ncu-source.csv"
fi

if ! skipped peers && [ -s "$OUT/cuda_bench.jsonl" ]; then
  t0=$SECONDS
  python3 "$ROOT/bench/torch_peers.py" "$OUT/cuda_bench.jsonl" --markdown "$OUT/perf_table.md" > "$LOG/torch_peers.txt" 2> "$LOG/torch_peers.log"
  status "torch peers (eager, compile)" "rc=$? ($((SECONDS - t0)) s)"
fi

if ! skipped python; then  # the PyTorch package against the installed torch (no network needed)
  t0=$SECONDS
  PYV=$BUILD/pyvenv
  if [ ! -x "$PYV/bin/python" ]; then
    python3 -m venv --system-site-packages "$PYV" > "$LOG/pyvenv.log" 2>&1
    # NOTE: python3 may itself be a venv (e.g. an image whose torch lives in a venv), whose
    # packages --system-site-packages does not reach; a .pth file adds them.
    python3 -c 'import site; print("\n".join(site.getsitepackages()))' > "$("$PYV/bin/python" -c 'import site; print(site.getsitepackages()[0])')/mxq-parent-env.pth"
  fi
  if (cd "$ROOT" && MXQ_LIBMXQ_BUILD_DIR="$BUILD" MAX_JOBS=$JOBS "$PYV/bin/python" -m pip install --no-build-isolation \
        --no-deps --no-index -v . > "$LOG/pip-install.log" 2>&1); then
    status "python: pip install" "ok ($((SECONDS - t0)) s)"
    if ! skipped pytest; then
      t0=$SECONDS
      (cd "$ROOT" && "$PYV/bin/python" -m pytest ${MXQ_CHECK_PYTEST:-tests/python} -v -rs > "$OUT/pytest.txt" 2>&1)
      rc=$?
      status "python: pytest tests/python" "$(tail -1 "$OUT/pytest.txt") rc=$rc ($((SECONDS - t0)) s)"
      [ $rc -ne 0 ] && grep -E '^(FAILED|ERROR)' "$OUT/pytest.txt" | head -20
    fi
    PEERS_PATH=""  # the peers' wheels (.whl/, e.g. humming-kernels), installed once into a target dir
    if [ -n "${MXQ_CHECK_LINEAR_PEERS:-}${MXQ_CHECK_MOE_PEERS:-}" ] && ls "$ROOT"/.whl/*.whl > /dev/null 2>&1; then
      "$PYV/bin/python" -m pip install --no-index --no-deps --target "$BUILD/peers-site" "$ROOT"/.whl/*.whl > "$LOG/peers-pip.log" 2>&1
      PEERS_PATH="$BUILD/peers-site"
    fi
    if [ -n "${MXQ_CHECK_LINEAR_PEERS:-}" ]; then
      PYTHONPATH="$PEERS_PATH${PYTHONPATH:+:$PYTHONPATH}" "$PYV/bin/python" "$ROOT/bench/linear_peers.py" $MXQ_CHECK_LINEAR_PEERS \
        > "$OUT/linear_peers.md" 2> "$LOG/linear_peers.txt"
      status "python: linear_peers $MXQ_CHECK_LINEAR_PEERS" "rc=$? (linear_peers.md)"
    fi
    if [ -n "${MXQ_CHECK_MOE_PEERS:-}" ]; then  # the W4A16 MoE against bf16 grouped GEMM, Humming, triton
      t0=$SECONDS
      PYTHONPATH="$PEERS_PATH${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1 "$PYV/bin/python" "$ROOT/bench/moe_peers.py" \
        $MXQ_CHECK_MOE_PEERS --out "$OUT/moe_peers.jsonl" > "$OUT/moe_peers.md" 2> "$LOG/moe_peers.txt"
      rc=$?
      status "python: moe_peers $MXQ_CHECK_MOE_PEERS" "rc=$rc ($((SECONDS - t0)) s, moe_peers.md)"
      [ $rc -ne 0 ] && tail -20 "$LOG/moe_peers.txt"
    fi
    for m in ${MXQ_CHECK_E2E_PROFILE:-}; do  # torch.profiler of one prefill per variant
      PYTHONUNBUFFERED=1 "$PYV/bin/python" "$ROOT/bench/generate_bench.py" --model "$m" --profile "$OUT/profile-$m.txt" > "$LOG/profile-$m.txt" 2>&1
      status "python: prefill profile $m" "rc=$? (profile-$m.txt)"
    done
    for m in ${MXQ_CHECK_E2E:-}; do
      t0=$SECONDS
      PYTHONUNBUFFERED=1 "$PYV/bin/python" "$ROOT/bench/generate_bench.py" --model "$m" ${MXQ_CHECK_E2E_ARGS:-} --markdown "$OUT/e2e-$m.md" > "$LOG/e2e-$m.txt" 2>&1
      rc=$?
      status "python: generate_bench $m" "rc=$rc ($((SECONDS - t0)) s, e2e-$m.md)"
      [ $rc -ne 0 ] && tail -20 "$LOG/e2e-$m.txt"
    done
    if ! skipped bench; then
      "$PYV/bin/python" "$ROOT/bench/torch_ops_bench.py" --markdown "$OUT/torch_ops_bench.md" > "$LOG/torch_ops_bench.txt" 2>&1
      status "python: torch_ops_bench" "rc=$? (torch_ops_bench.md)"
    fi
  else
    status "python: pip install" FAILED; tail -30 "$LOG/pip-install.log"
  fi
fi

if [ -n "${MXQ_CHECK_CKPT_GB:-}" ]; then  # optional: checkpoint conversion throughput and peak memory
  t0=$SECONDS
  python3 "$ROOT/bench/checkpoint_bench.py" --mxq "$BUILD/tools/mxq/mxq" --gb "$MXQ_CHECK_CKPT_GB" \
    --dir "${TMPDIR:-/tmp}/mxq-ckpt-bench" --device cpu --device cuda --markdown "$OUT/checkpoint_bench.md" \
    > "$LOG/checkpoint_bench.txt" 2>&1
  status "checkpoint conversion bench" "rc=$? ($((SECONDS - t0)) s, checkpoint_bench.md)"
fi

tar czf "$OUT/logs.tgz" -C "$OUT" logs; cp "$LOG/cuda_bench.txt" "$OUT/" 2>/dev/null
echo; cat "$LOG/machine.txt"; echo; cat "$OUT/summary.txt"; echo
if [ -s "$OUT/perf_table.md" ]; then cat "$OUT/perf_table.md"; elif [ -s "$OUT/cuda_bench.txt" ]; then cat "$OUT/cuda_bench.txt"; fi
[ -s "$OUT/torch_ops_bench.md" ] && { echo; cat "$OUT/torch_ops_bench.md"; }
[ -s "$OUT/linear_bench.txt" ] && { echo; cat "$OUT/linear_bench.txt"; }
[ -s "$OUT/linear_peers.md" ] && { echo; cat "$OUT/linear_peers.md"; }
[ -s "$OUT/moe_peers.md" ] && { echo; sed -n '/^# summary/,$p' "$OUT/moe_peers.md"; }
[ -s "$OUT/checkpoint_bench.md" ] && { echo; cat "$OUT/checkpoint_bench.md"; }
for f in "$OUT"/e2e-*.md; do [ -s "$f" ] && { echo; cat "$f"; }; done
rm -rf "$LOG"
