// The W4A16 prefill kernel (w4a16_wgmma.cuh) against the mma.sync kernel and cuBLAS bf16, on the benchmark
// shapes at M = 128 .. 4096: a byte-equality check on data whose fp32 sums are exact, then times (median,
// weights rotated over copies larger than L2).
//   nvcc -std=c++20 -O3 -gencode=arch=compute_90a,code=sm_90a --expt-relaxed-constexpr -Isrc -Iinclude \
//        dev/probes/wgmma_probe.cu -lcublas -lcuda -o wgmma_probe
//   wgmma_probe [reps] [shape index] [M] [variant: a name substring, or =name exactly (the reference
//   variant, the first, always runs)]
#include <cuda.h>
#include <cudaTypedefs.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <functional>
#include <random>
#include <string>
#include <vector>

#include <cublas_v2.h>

#include "cuda/gemm/w4a16.cuh"
#include "cuda/gemm/w4a16_wgmma.cuh"

using namespace mxq::cuda::gemm;

#define CK(x)                                                                                        \
  do {                                                                                               \
    cudaError_t e_ = (x);                                                                            \
    if (e_ != cudaSuccess) {                                                                         \
      std::printf("CUDA error %s at %s:%d: %s\n", cudaGetErrorString(e_), __FILE__, __LINE__, #x); \
      std::exit(1);                                                                                  \
    }                                                                                                \
  } while (0)

static PFN_cuTensorMapEncodeTiled_v12000 g_encode = nullptr;

CUtensorMap x_map(const LinearArgs& a, int bm) {
  CUtensorMap m;
  const cuuint64_t dims[2] = {cuuint64_t(a.K), cuuint64_t(a.M)};
  const cuuint64_t strides[1] = {cuuint64_t(a.x_stride) * 2};
  const cuuint32_t box[2] = {64, cuuint32_t(bm)};
  const cuuint32_t es[2] = {1, 1};
  const CUresult r = g_encode(&m, CU_TENSOR_MAP_DATA_TYPE_BFLOAT16, 2, const_cast<std::uint16_t*>(a.x), dims, strides, box, es,
                              CU_TENSOR_MAP_INTERLEAVE_NONE, CU_TENSOR_MAP_SWIZZLE_NONE, CU_TENSOR_MAP_L2_PROMOTION_L2_256B,
                              CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
  if (r != CUDA_SUCCESS) {
    std::printf("cuTensorMapEncodeTiled failed: %d\n", int(r));
    std::exit(1);
  }
  return m;
}

template <int BM, int STRIPS, int STAGES, int PF, bool EPI = false, int KSPLIT = 1, int RAW = wg::kRaw, int WAIT = 1, bool WS = false>
void launch_wg(const LinearArgs& a, cudaStream_t s) {
  auto k = w4a16_wgmma_kernel<BM, STRIPS, STAGES, PF, false, false, EPI, KSPLIT, RAW, WAIT, WS>;
  constexpr int smem = wg::smem_bytes<BM, STRIPS, KSPLIT>(STAGES, RAW, WS ? PF : 0);
  static bool once = [&] {
    CK(cudaFuncSetAttribute(k, cudaFuncAttributeMaxDynamicSharedMemorySize, smem));
    cudaFuncAttributes fa;
    CK(cudaFuncGetAttributes(&fa, k));
    std::printf("    [wgmma BM%d S%d st%d pf%d epi%d k%d raw%d wait%d ws%d: %d registers, %zu local bytes, smem %d]\n", BM, STRIPS, STAGES, PF, int(EPI), KSPLIT, RAW, WAIT, int(WS), fa.numRegs,
                fa.localSizeBytes, smem);
    return true;
  }();
  (void)once;
  const CUtensorMap m = x_map(a, BM);
  const long nstrips = (a.N + 31) / 32 * 2;
  cudaLaunchConfig_t cfg{};
  cfg.gridDim = dim3(unsigned((nstrips + 8 * STRIPS - 1) / (8 * STRIPS) * KSPLIT), unsigned((a.M + BM - 1) / BM), 1);
  cfg.blockDim = dim3(wg::kThreads);
  cfg.dynamicSmemBytes = smem;
  cfg.stream = s;
  cudaLaunchAttribute at[2];
  at[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
  at[0].val.programmaticStreamSerializationAllowed = 1;
  at[1].id = cudaLaunchAttributeClusterDimension;
  at[1].val.clusterDim.x = KSPLIT;
  at[1].val.clusterDim.y = 1;
  at[1].val.clusterDim.z = 1;
  cfg.attrs = at;
  cfg.numAttrs = KSPLIT > 1 ? 2 : 1;
  CK(cudaLaunchKernelEx(&cfg, k, m, a));
}

template <int TOKENS, int WN, bool XS>
void launch_reg(const LinearArgs& a, cudaStream_t s) {
  auto k = w4a16_kernel<TOKENS, 4, WN, 1, false, false, XS>;
  constexpr int smem = linear_smem_bytes<TOKENS, WN, XS>();
  CK(cudaFuncSetAttribute(k, cudaFuncAttributeMaxDynamicSharedMemorySize, smem));
  k<<<dim3(unsigned((a.N + 32 * WN - 1) / (32 * WN)), unsigned((a.M + TOKENS - 1) / TOKENS)), 256, smem, s>>>(a);
}

struct Variant {
  std::string name;
  std::function<void(const LinearArgs&, cudaStream_t)> go;
  int min_m = 0, max_m = 1 << 30;  // the M range it runs at
};

int main(int argc, char** argv) {
  const int reps = argc > 1 ? std::atoi(argv[1]) : 20;
  const int only_shape = argc > 2 ? std::atoi(argv[2]) : -1, only_m = argc > 3 ? std::atoi(argv[3]) : 0;
  const std::string only_variant = argc > 4 ? argv[4] : "";
  cudaDriverEntryPointQueryResult q;
  CK(cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", reinterpret_cast<void**>(&g_encode), 12000, cudaEnableDefault, &q));
  if (!g_encode) return 1;
  cudaStream_t st;
  CK(cudaStreamCreateWithFlags(&st, cudaStreamNonBlocking));
  const std::vector<std::pair<long, long>> shapes = {{4096, 4096}, {14336, 4096}, {4096, 14336}, {8192, 8192}, {28672, 8192}, {2880, 2880}, {360, 2880}};
  const std::vector<int> Ms = {32, 64, 100, 128, 256, 1024, 4096};
  cublasHandle_t blas;
  if (cublasCreate(&blas) != CUBLAS_STATUS_SUCCESS) return 1;
  cublasSetStream(blas, st);
  cudaEvent_t e0, e1;
  CK(cudaEventCreate(&e0));
  CK(cudaEventCreate(&e1));
  std::mt19937 rng(1);
  for (std::size_t si = 0; si < shapes.size(); ++si) {
    if (only_shape >= 0 && int(si) != only_shape) continue;
    const auto [N, K] = shapes[si];
    const long Np = (N + 31) / 32 * 32, katoms = (K + 63) / 64;
    const long code_bytes = Np * katoms * 64 / 2, scale_bytes_ = Np / 16 * katoms * 32;
    const double wbytes = double(code_bytes + scale_bytes_);
    const int copies = std::max(2, int(128e6 / wbytes) + 1);
    std::vector<unsigned char> hc(code_bytes), hs(scale_bytes_);
    for (auto& b : hc) b = rng() & 0xFF;
    std::vector<uint4*> codes(copies);
    std::vector<std::uint8_t*> scales(copies);
    for (int c = 0; c < copies; ++c) {
      CK(cudaMalloc(&codes[c], code_bytes));
      CK(cudaMalloc(&scales[c], scale_bytes_));
      CK(cudaMemcpy(codes[c], hc.data(), code_bytes, cudaMemcpyHostToDevice));
      for (auto& b : hs) b = c == 0 ? 127 : 120 + rng() % 11;
      CK(cudaMemcpy(scales[c], hs.data(), scale_bytes_, cudaMemcpyHostToDevice));
    }
    std::uint16_t* wd[2];
    for (auto& p : wd) {
      CK(cudaMalloc(&p, std::size_t(N) * K * 2));
      CK(cudaMemset(p, 0x3c, std::size_t(N) * K * 2));
    }
    for (int M : Ms) {
      if (only_m && M != only_m) continue;
      std::vector<std::uint16_t> hx(std::size_t(M) * K);
      for (auto& v : hx) {
        const int i = int(rng() % 5) - 2;  // -2 .. 2 in bf16
        v = i == 0 ? 0 : (i < 0 ? 0x8000 : 0) | (std::abs(i) == 1 ? 0x3F80 : 0x4000);
      }
      std::uint16_t *x, *y, *yref;
      CK(cudaMalloc(&x, hx.size() * 2));
      CK(cudaMemcpy(x, hx.data(), hx.size() * 2, cudaMemcpyHostToDevice));
      CK(cudaMalloc(&y, std::size_t(M) * N * 2));
      CK(cudaMalloc(&yref, std::size_t(M) * N * 2));
      LinearArgs a{};
      a.x = x;
      a.M = M;
      a.N = N;
      a.K = K;
      a.x_stride = K;
      a.y_stride = N;
      a.katoms = int(katoms);
      a.exp_shift = 2;
      a.mul = 4.0f;
      a.div = 1.0f;
      std::vector<Variant> vs;
      vs.push_back({"mma t64", launch_reg<64, 1, false>});
      vs.push_back({"mma t32 w4 xs", launch_reg<32, 4, true>, 0, 32});
      vs.push_back({"mma t32 w2 xs", launch_reg<32, 2, true>, 0, 32});
      vs.push_back({"mma t64 w4 xs", launch_reg<64, 4, true>, 33, 256});
      vs.push_back({"mma t64 w2 xs", launch_reg<64, 2, true>, 33, 256});
      // Split K over a cluster (k2, k4); raw x tiles in flight (r); weight tiles ahead (pf); k16 groups
      // left in flight (w).
      vs.push_back({"wgmma n32 s2 pf4 k2", launch_wg<32, 2, 8, 4, false, 2>, 0, 32});
      vs.push_back({"wgmma n32 s2 pf4 k2 w2", launch_wg<32, 2, 8, 4, false, 2, 3, 2>, 0, 32});
      vs.push_back({"wgmma n32 s2 pf4 k2 w3", launch_wg<32, 2, 8, 4, false, 2, 3, 3>, 0, 32});
      vs.push_back({"wgmma n32 s2 pf4 k4 w2", launch_wg<32, 2, 8, 4, false, 4, 3, 2>, 0, 32});
      vs.push_back({"wgmma n32 s1 pf8 k4 w3", launch_wg<32, 1, 8, 8, false, 4, 3, 3>, 0, 32});
      vs.push_back({"wgmma n64 s2 pf4 k2", launch_wg<64, 2, 6, 4, false, 2>, 33, 128});
      vs.push_back({"wgmma n64 s2 pf4 k2 w2", launch_wg<64, 2, 6, 4, false, 2, 3, 2>, 33, 128});
      vs.push_back({"wgmma n64 s2 pf4 k2 w3", launch_wg<64, 2, 6, 4, false, 2, 3, 3>, 33, 128});
      vs.push_back({"wgmma n64 s2 pf4 k4 w2", launch_wg<64, 2, 6, 4, false, 4, 3, 2>, 33, 128});
      vs.push_back({"wgmma n64 s1 pf4 k2 w3", launch_wg<64, 1, 6, 4, false, 2, 3, 3>, 33, 128});
      vs.push_back({"wgmma n64 s1 pf8 k4 w3", launch_wg<64, 1, 6, 8, false, 4, 3, 3>, 33, 128});
      vs.push_back({"wgmma n128 s2 pf4 k2", launch_wg<128, 2, 4, 4, false, 2>, 65, 1024});
      vs.push_back({"wgmma n128 s2 pf4 k2 w2", launch_wg<128, 2, 4, 4, false, 2, 3, 2>, 65, 1024});
      vs.push_back({"wgmma n128 s2 pf4 k2 w3", launch_wg<128, 2, 4, 4, false, 2, 3, 3>, 65, 1024});
      vs.push_back({"wgmma n128 s1 pf4 k2 w3", launch_wg<128, 1, 4, 4, false, 2, 3, 3>, 65, 1024});
      // One CTA per tile over the whole of K.
      vs.push_back({"wgmma n128 s1 pf4 epi", launch_wg<128, 1, 4, 4, true>, 65});
      vs.push_back({"wgmma n128 s1 pf4 epi w3", launch_wg<128, 1, 4, 4, true, 1, 3, 3>, 65});
      vs.push_back({"wgmma n128 s2 pf4 epi", launch_wg<128, 2, 4, 4, true>, 65});
      vs.push_back({"wgmma n128 s2 pf4 epi w2", launch_wg<128, 2, 4, 4, true, 1, 3, 2>, 65});
      vs.push_back({"wgmma n128 s2 pf4 epi w3", launch_wg<128, 2, 4, 4, true, 1, 3, 3>, 65});
      vs.push_back({"wgmma n128 s2 pf2 epi w3", launch_wg<128, 2, 4, 2, true, 1, 3, 3>, 65});
      // The weights through a cp.async ring in shared memory (ws), PF slots per warp.
      vs.push_back({"wgmma n128 s2 pf4 epi ws", launch_wg<128, 2, 4, 4, true, 1, 3, 1, true>, 65});
      vs.push_back({"wgmma n128 s2 pf6 epi ws", launch_wg<128, 2, 4, 6, true, 1, 3, 1, true>, 65});
      vs.push_back({"wgmma n128 s2 pf8 epi ws", launch_wg<128, 2, 4, 8, true, 1, 3, 1, true>, 65});
      vs.push_back({"wgmma n128 s2 pf6 k2 ws", launch_wg<128, 2, 4, 6, false, 2, 3, 1, true>, 65, 1024});
      vs.push_back({"wgmma n64 s2 pf6 k2 ws", launch_wg<64, 2, 6, 6, false, 2, 3, 1, true>, 33, 128});
      vs.push_back({"wgmma n128 s1 pf6 k2 ws", launch_wg<128, 1, 4, 6, false, 2, 3, 1, true>, 65, 1024});
      if (!only_variant.empty())
        for (std::size_t v = 1; v < vs.size(); ++v)
          if (only_variant[0] == '=' ? vs[v].name != only_variant.substr(1) : vs[v].name.find(only_variant) == std::string::npos)
            vs[v].min_m = 1 << 30;
      std::vector<std::uint16_t> r0(std::size_t(M) * N), r1(r0.size());
      a.codes = codes[0];
      a.scales = scales[0];
      for (std::size_t v = 0; v < vs.size(); ++v) {
        if (M < vs[v].min_m || M > vs[v].max_m) continue;
        a.y = v == 0 ? yref : y;
        CK(cudaMemsetAsync(a.y, 0xFF, std::size_t(M) * N * 2, st));
        vs[v].go(a, st);
        CK(cudaStreamSynchronize(st));
        if (v == 0) {
          CK(cudaMemcpy(r0.data(), yref, r0.size() * 2, cudaMemcpyDeviceToHost));
        } else {
          CK(cudaMemcpy(r1.data(), y, r1.size() * 2, cudaMemcpyDeviceToHost));
          long bad = 0, first = -1;
          for (std::size_t i = 0; i < r0.size(); ++i)
            if (r0[i] != r1[i]) {
              if (first < 0) first = long(i);
              ++bad;
            }
          if (bad && K % 64 == 0)
            std::printf("MISMATCH %s N=%ld K=%ld M=%d: %ld of %zu, first at m=%ld n=%ld: %04x vs %04x\n", vs[v].name.c_str(), N, K, M,
                        bad, r0.size(), first / N, first % N, r0[first], r1[first]);
        }
      }
      a.y = y;
      std::vector<float> tb;
      const float alpha = 1.0f, beta = 0.0f;
      for (int r = 0; r < reps; ++r) {
        CK(cudaEventRecord(e0, st));
        cublasGemmEx(blas, CUBLAS_OP_T, CUBLAS_OP_N, int(N), M, int(K), &alpha, wd[r & 1], CUDA_R_16BF, int(K), x, CUDA_R_16BF, int(K),
                     &beta, y, CUDA_R_16BF, int(N), CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT);
        CK(cudaEventRecord(e1, st));
        CK(cudaEventSynchronize(e1));
        float ms;
        CK(cudaEventElapsedTime(&ms, e0, e1));
        tb.push_back(ms * 1000);
      }
      std::sort(tb.begin(), tb.end());
      const double cub = tb[tb.size() / 2];
      std::printf("N=%ld K=%ld M=%d  cuBLAS bf16 %8.2f us %6.1f TFLOP/s\n", N, K, M, cub, 2.0 * M * N * K / cub / 1e6);
      for (auto& v : vs) {
        if (M < v.min_m || M > v.max_m) continue;
        std::vector<float> t;
        for (int r = 0; r < reps; ++r) {
          const int c = 1 + r % (copies - 1);
          a.codes = codes[c];
          a.scales = scales[c];
          CK(cudaEventRecord(e0, st));
          v.go(a, st);
          CK(cudaEventRecord(e1, st));
          CK(cudaEventSynchronize(e1));
          float ms;
          CK(cudaEventElapsedTime(&ms, e0, e1));
          t.push_back(ms * 1000);
        }
        std::sort(t.begin(), t.end());
        const double med = t[t.size() / 2];
        std::printf("  %-20s %8.2f us %6.1f TFLOP/s  %5.2fx cuBLAS\n", v.name.c_str(), med, 2.0 * M * N * K / med / 1e6, cub / med);
      }
      CK(cudaGetLastError());
      CK(cudaFree(x));
      CK(cudaFree(y));
      CK(cudaFree(yref));
    }
    for (int c = 0; c < copies; ++c) {
      CK(cudaFree(codes[c]));
      CK(cudaFree(scales[c]));
    }
    for (auto& p : wd) CK(cudaFree(p));
  }
  std::printf("done\n");
  return 0;
}
