// dev/probes/bf16_mma_bound.cu (built with -DMXQ_BUILD_PROBES=ON, or nvcc -O2 -arch=sm_90a bf16_mma_bound.cu
// -o bf16_mma_bound; run ./bf16_mma_bound on an sm_90 GPU).
// Probe for MatrixPrecision::bf16 (docs/numerics.md, "Runtime RS x RS matrices"): the error of
// mma.sync m16n8k16 bf16 -> fp32, chained over the RS/16 k-steps from a +0 accumulator as
// src/cuda/rotate/matrix_bf16.cuh does, against the exact (double) sum, in units of the stated bound
// B = RS 2^-20 sum_i |x_i R_ij| + RS 2^-126. Inputs chosen to stress it: random data; one unit term
// with RS-1 terms just below 2^-23 of it (what a truncating alignment drops); the same with
// alternating signs; products below fp32's normal range; all -0; partial sums that overflow fp32 (the
// documented exception). Prints, per case and RS: max |y' - y| / B, the worst error in units of
// RS * 2^-23 * sum |x_i R_ij|, the count of values outside B, of non-finite values, and of -0 results
// (the kernel adds +0.0f to those).
#include <cuda_runtime.h>

#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <random>
#include <vector>

using u16 = std::uint16_t;
using u32 = std::uint32_t;

// One warp per 16 groups of RS: y[g][j] = sum_i x[g][i] R[i][j] (x, R bf16 bits, row-major).
template <int RS>
__global__ void product(const u16* x, const u16* r, float* y) {
  constexpr int NT = RS / 8, KS = RS / 16;
  const int lane = threadIdx.x, gr = lane >> 2, kq = lane & 3;
  x += std::size_t(blockIdx.x) * 16 * RS;
  y += std::size_t(blockIdx.x) * 16 * RS;
  const auto xa = [&](int row, int k) { return u32(x[row * RS + k]) | u32(x[row * RS + k + 1]) << 16; };
  const auto rb = [&](int k, int n) { return u32(r[k * RS + n]) | u32(r[(k + 1) * RS + n]) << 16; };
  float d[NT][4] = {};
  for (int ks = 0; ks < KS; ++ks) {
    const int k = 16 * ks + 2 * kq;
    const u32 a0 = xa(gr, k), a1 = xa(gr + 8, k), a2 = xa(gr, k + 8), a3 = xa(gr + 8, k + 8);
    for (int t = 0; t < NT; ++t) {
      const u32 b0 = rb(k, 8 * t + gr), b1 = rb(k + 8, 8 * t + gr);
      asm volatile(
          "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
          "{%0, %1, %2, %3};\n"
          : "+f"(d[t][0]), "+f"(d[t][1]), "+f"(d[t][2]), "+f"(d[t][3])
          : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
    }
  }
  for (int t = 0; t < NT; ++t)
    for (int e = 0; e < 4; ++e) y[(gr + 8 * (e / 2)) * RS + 8 * t + 2 * kq + e % 2] = d[t][e];
}

u16 bf16(float f) {  // round to nearest even (finite inputs)
  u32 u;
  std::memcpy(&u, &f, 4);
  return u16((u + 0x7FFFu + ((u >> 16) & 1u)) >> 16);
}
double value(u16 h) {
  const u32 u = u32(h) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

template <int RS>
void check(const char* name, const std::vector<u16>& x, const std::vector<u16>& r) {
  const std::size_t n = x.size();
  u16 *dx, *dr;
  float* dy;
  cudaMalloc(&dx, n * 2);
  cudaMalloc(&dr, RS * RS * 2);
  cudaMalloc(&dy, n * 4);
  cudaMemcpy(dx, x.data(), n * 2, cudaMemcpyHostToDevice);
  cudaMemcpy(dr, r.data(), RS * RS * 2, cudaMemcpyHostToDevice);
  product<RS><<<unsigned(n / (16 * RS)), 32>>>(dx, dr, dy);
  std::vector<float> y(n);
  cudaMemcpy(y.data(), dy, n * 4, cudaMemcpyDeviceToHost);
  if (cudaGetLastError() != cudaSuccess) std::printf("%s: CUDA error\n", name);
  cudaFree(dx), cudaFree(dr), cudaFree(dy);
  double worst = 0, worst_u = 0;
  long outside = 0, nonfinite = 0, neg0 = 0;
  for (std::size_t g = 0; g < n / RS; ++g)
    for (int j = 0; j < RS; ++j) {
      double s = 0, a = 0;
      for (int i = 0; i < RS; ++i) {
        const double p = value(x[g * RS + i]) * value(r[i * RS + j]);
        s += p, a += std::fabs(p);
      }
      const float v = y[g * RS + j];
      if (!std::isfinite(v)) {
        ++nonfinite;
        continue;
      }
      neg0 += v == 0.0f && std::signbit(v);
      const double bound = RS * std::ldexp(a, -20) + RS * std::ldexp(1.0, -126), e = std::fabs(double(v) - s);
      outside += e > bound;
      worst = std::fmax(worst, e / bound);
      if (a > 0) worst_u = std::fmax(worst_u, e / (RS * std::ldexp(a, -23)));
    }
  std::printf("%-28s RS %3d  max err/B %.4f  max err/(RS u sum|p|) %.3f  outside B %ld  non-finite %ld  -0 %ld\n", name, RS,
              worst, worst_u, outside, nonfinite, neg0);
}

template <int RS>
void cases() {
  std::mt19937 rng(RS);
  std::normal_distribution<float> nd;
  const std::size_t n = std::size_t(64) * 16 * RS;
  std::vector<u16> x(n), r(RS * RS), ones(RS * RS, bf16(1.0f)), tiny_r(RS * RS, bf16(std::ldexp(1.0f, -60)));
  for (u16& v : r) v = bf16(nd(rng) * 0.3f);
  for (u16& v : x) v = bf16(nd(rng) * (rng() % 50 ? 1.0f : 100.0f));
  check<RS>("random", x, r);
  const float below = std::ldexp(1.9921875f, -24);  // just under one ulp of 1 in fp32 (0.996 x 2^-23)
  for (std::size_t i = 0; i < n; ++i) x[i] = bf16(i % RS ? below : 1.0f);
  check<RS>("one + many below its ulp", x, ones);
  for (std::size_t i = 0; i < n; ++i) x[i] = bf16((i / 8 % 2 ? -1.0f : 1.0f) * (i % RS ? below : 1.0f));
  check<RS>("the same, alternating signs", x, ones);
  for (std::size_t i = 0; i < n; ++i) x[i] = bf16(std::ldexp(1.5f, -67));
  check<RS>("subnormal products", x, tiny_r);
  for (std::size_t i = 0; i < n; ++i) x[i] = bf16(-0.0f);
  check<RS>("all -0", x, ones);
  for (std::size_t i = 0; i < n; ++i) x[i] = bf16(i % RS < RS / 2 ? 3e38f : -3e38f);
  check<RS>("overflowing partial sums", x, ones);
}

int main() {
  cases<16>();
  cases<32>();
  cases<64>();
  cases<128>();
  return 0;
}
