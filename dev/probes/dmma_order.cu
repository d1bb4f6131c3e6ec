// dev/probes/dmma_order.cu (built with -DMXQ_BUILD_PROBES=ON, or nvcc -O2 -arch=sm_90a dmma_order.cu -o dmma_order;
// run ./dmma_order on an sm_90 GPU).
// Probe: does mma.sync m8n8k4 f64 compute D = fma(a3,b3, fma(a2,b2, fma(a1,b1, fma(a0,b0, c))))
// (sequential FMAs in ascending k, RNE)? Compared over adversarial random data, chained over k-tiles.
#include <cstdio>
#include <cstdint>
#include <cmath>
#include <cstring>
#include <vector>
#include <random>
#include <cuda_runtime.h>
__device__ __forceinline__ void dmma(double& d0, double& d1, double a, double b, double c0, double c1) {
  asm volatile("mma.sync.aligned.m8n8k4.row.col.f64.f64.f64.f64 {%0,%1}, {%2}, {%3}, {%4,%5};\n"
               : "=d"(d0), "=d"(d1) : "d"(a), "d"(b), "d"(c0), "d"(c1));
}
// A: 8 x K row-major, B: K x 8 (B[k][n] at k*8+n), D: 8x8; K multiple of 4.
__global__ void k_mma(const double* A, const double* B, double* D, int K) {
  int lane = threadIdx.x;
  double d0 = 0.0, d1 = 0.0;
  for (int k0 = 0; k0 < K; k0 += 4) {
    double a = A[(lane / 4) * K + k0 + lane % 4];
    double b = B[(k0 + lane % 4) * 8 + lane / 4];
    dmma(d0, d1, a, b, d0, d1);
  }
  D[(lane / 4) * 8 + 2 * (lane % 4)] = d0;
  D[(lane / 4) * 8 + 2 * (lane % 4) + 1] = d1;
}
__global__ void k_tput(double* out, int iters) {
  double a = threadIdx.x * 1e-3, b = 1.0 + blockIdx.x * 1e-9;
  double d[8][2] = {};
  for (int i = 0; i < iters; ++i) {
#pragma unroll
    for (int t = 0; t < 8; ++t) dmma(d[t][0], d[t][1], a, b, d[t][0], d[t][1]);
  }
  double s = 0; for (int t = 0; t < 8; ++t) s += d[t][0] + d[t][1];
  if (s == 1234.5) out[0] = s;
}
int main() {
  std::mt19937_64 rng(1);
  int bad_seq = 0, bad_sum = 0, total = 0;
  for (int trial = 0; trial < 2000; ++trial) {
    int K = 4 * (1 + trial % 64);
    std::vector<double> A(8 * K), B(K * 8), D(64);
    std::uniform_real_distribution<double> u(-1, 1);
    std::uniform_int_distribution<int> ex(-40, 40);
    for (auto& v : A) v = (double)(float)std::ldexp(u(rng), trial % 3 == 0 ? ex(rng) : ex(rng) / 8);
    for (auto& v : B) v = (double)(float)std::ldexp(u(rng), trial % 2 == 0 ? ex(rng) : 0);
    if (trial % 5 == 0) for (int i = 0; i + 2 < K; i += 3) { A[i] = 1.0; B[i * 8] = 1e30 * (i % 2 ? 1 : -1); }
    double *dA, *dB, *dD;
    cudaMalloc(&dA, A.size() * 8); cudaMalloc(&dB, B.size() * 8); cudaMalloc(&dD, 64 * 8);
    cudaMemcpy(dA, A.data(), A.size() * 8, cudaMemcpyHostToDevice);
    cudaMemcpy(dB, B.data(), B.size() * 8, cudaMemcpyHostToDevice);
    k_mma<<<1, 32>>>(dA, dB, dD, K);
    cudaMemcpy(D.data(), dD, 64 * 8, cudaMemcpyDeviceToHost);
    cudaFree(dA); cudaFree(dB); cudaFree(dD);
    for (int m = 0; m < 8; ++m) for (int n = 0; n < 8; ++n) {
      double s = 0.0;
      for (int k = 0; k < K; ++k) s = std::fma(A[m * K + k], B[k * 8 + n], s);
      long double e = 0; for (int k = 0; k < K; ++k) e += (long double)A[m * K + k] * B[k * 8 + n];
      ++total;
      if (std::memcmp(&s, &D[m * 8 + n], 8) != 0) { if (bad_seq < 5) printf("seq mismatch trial %d m%d n%d: gpu %.17g seq %.17g\n", trial, m, n, D[m*8+n], s); ++bad_seq; }
      if ((float)s != (float)D[m * 8 + n]) ++bad_sum;
    }
  }
  printf("DMMA vs sequential fma: %d of %d differ (%d after rounding to fp32)\n", bad_seq, total, bad_sum);
  double* o; cudaMalloc(&o, 8);
  cudaEvent_t e0, e1; cudaEventCreate(&e0); cudaEventCreate(&e1);
  int sms; cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0);
  k_tput<<<sms * 4, 256>>>(o, 100);
  cudaEventRecord(e0); int iters = 2000; k_tput<<<sms * 4, 256>>>(o, iters); cudaEventRecord(e1); cudaEventSynchronize(e1);
  float ms; cudaEventElapsedTime(&ms, e0, e1);
  double fma = double(sms) * 4 * 8 * iters * 8 * 256;
  printf("DMMA throughput: %.1f TFLOP/s (%.1f ms)\n", 2 * fma / ms / 1e9, ms);
}
