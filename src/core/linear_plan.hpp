#pragma once
// The W4A16 linear's static tile table (docs/linear.md), per (architecture, M, N, K). Host code only.
#include <cstdint>
#include <string>

namespace mxq::core {

struct LinearPlan {
  int tokens;           // tokens (rows of x) per CTA tile: the mma's n side, 8, 16, 32 or 64
  int ksplit;           // warps of a CTA (8)
  int depth;            // 64-column weight tiles each warp keeps in flight
  int groups;           // 32-row groups of W per CTA; the warps of a group split the CTA's share of K
  int cluster;          // CTAs of a cluster (sm90) splitting K further, reduced in rank order
  bool xstage;          // x staged per K slice in a shared-memory ring (cp.async) instead of read through L1
  int sm;               // the architecture the plan is for (major * 10 + minor)
  bool wgmma;           // the sm90a prefill kernel (w4a16_wgmma.cuh): tokens = its BM, groups = 4 x strips per warp
  std::int64_t grid_n;  // CTAs along N: groups x 32 weight rows each, times the cluster
  std::int64_t grid_m;  // CTAs along M
};

// sm: the device's compute capability as major * 10 + minor (90 for sm_90).
// NOTE: the rows come from timing every variant on each benchmark shape (dev/probes/linear_tile_probe.cu):
// at M <= 16 a wave of about two 4-deep CTAs per SM streams best; more 32-row strips than that go two to
// a CTA, and few strips of a long K (4096 x 14336) split K over a 2-CTA cluster. Wider groups and
// clusters at M >= 32 measured slower (the x fragments, read from L2 at 1 CTA per SM, bound those tiles).
// From M = 17 on, x staged in shared memory per K slice lifts that bound where 2 or 4 groups per CTA
// still give about two thirds of a wave of CTAs (88 of 132 SMs): the widest such tile is taken.
// The sm90a prefill kernel's tiles: BM tokens x 128 * strips rows of W per CTA (w4a16_wgmma.cuh); the
// first row that gives >= kWgmmaMinCtas CTAs is taken. Probe (H100): 128 tokens x 256 rows with the
// shared-memory epilogue was the fastest tile from M = 100 to 4096 wherever it gave >= 100 CTAs (1.4-2x
// the x-staged mma.sync tile); where only 128 x 128 gives that many (8192 x 8192 at M = 256, 14336 x 4096
// at M = 100..128) it beat the x-staged tile by 1.2-1.25x; 256 x 128 was slower.
struct WgmmaKernelRow {
  int bm, strips, stages, prefetch;
  bool smem_epilogue;
};
constexpr WgmmaKernelRow kWgmmaKernels[] = {{128, 2, 4, 4, true}, {128, 1, 4, 4, true}};
constexpr int kWgmmaMinCtas = 100;  // below this many CTAs the mma.sync tiles are faster (probe, H100)

// wgmma_ok: the library holds sm_90a code and the device runs it (cuda/gemm/linear_launch.cu).
inline LinearPlan plan_linear(std::int64_t N, std::int64_t K, std::int64_t M, int sm, bool wgmma_ok = false) {
  LinearPlan p{};
  const std::int64_t pairs_ = (N + 31) / 32;
  if (wgmma_ok && sm == 90 && M > 64) {
    for (const WgmmaKernelRow& r : kWgmmaKernels) {
      const std::int64_t ctas = (pairs_ + 4 * r.strips - 1) / (4 * r.strips) * ((M + r.bm - 1) / r.bm);
      if (ctas >= kWgmmaMinCtas) {
        p.wgmma = true;
        p.tokens = r.bm;
        p.groups = 4 * r.strips;
        p.depth = r.prefetch;
        p.ksplit = 8;
        p.cluster = 1;
        p.xstage = false;
        p.sm = sm;
        p.grid_n = (pairs_ + p.groups - 1) / p.groups;
        p.grid_m = (M + p.tokens - 1) / p.tokens;
        return p;
      }
    }
  }
  p.tokens = M <= 8 ? 8 : M <= 16 ? 16 : M <= 32 ? 32 : 64;
  p.ksplit = 8;
  p.groups = 1;
  p.cluster = 1;
  const std::int64_t pairs = (N + 31) / 32, katoms = (K + 63) / 64;
  if (p.tokens <= 16 && pairs >= 384) p.groups = 2;
  if (p.tokens == 8 && sm >= 90 && pairs <= 128 && katoms >= 128) p.cluster = 2;
  p.xstage = false;
  p.sm = sm;
  if (p.tokens >= 32) {
    const std::int64_t mtiles = (M + p.tokens - 1) / p.tokens;
    for (int wn : {4, 2})
      if ((pairs + wn - 1) / wn * mtiles >= 88) {
        p.groups = wn;
        p.xstage = true;
        break;
      }
  }
  p.depth = p.tokens <= 16 && p.groups == 1 && p.cluster == 1 && pairs < 256 ? 8 : 4;
  p.grid_n = (pairs + p.groups - 1) / p.groups * p.cluster;
  p.grid_m = (M + p.tokens - 1) / p.tokens;
  return p;
}

// The kernels compiled (cuda/gemm/linear_launch.cuh instantiates exactly these rows): tokens, depth,
// groups, cluster, x staged.
struct LinearKernelRow {
  int tokens, depth, groups, cluster;
  bool xstage;
  constexpr bool matches(const LinearPlan& p) const {
    return tokens == p.tokens && depth == p.depth && groups == p.groups && cluster == p.cluster && xstage == p.xstage;
  }
};
constexpr LinearKernelRow kLinearKernels[] = {
    {8, 8, 1, 1, false},  {8, 4, 1, 1, false},  {8, 4, 2, 1, false}, {8, 4, 1, 2, false}, {16, 8, 1, 1, false},
    {16, 4, 1, 1, false}, {16, 4, 2, 1, false}, {32, 4, 1, 1, false}, {32, 4, 2, 1, true}, {32, 4, 4, 1, true},
    {64, 4, 1, 1, false}, {64, 4, 2, 1, true},  {64, 4, 4, 1, true}};
inline bool has_kernel(const LinearPlan& p) {
  if (p.wgmma) {
    for (const WgmmaKernelRow& r : kWgmmaKernels)
      if (r.bm == p.tokens && 4 * r.strips == p.groups && r.prefetch == p.depth) return true;
    return false;
  }
  for (const LinearKernelRow& r : kLinearKernels)
    if (r.matches(p)) return true;
  return false;
}

inline std::string to_string(const LinearPlan& p) {
  if (p.wgmma)
    return "wgmma (sm90a), tokens per tile " + std::to_string(p.tokens) + ", weight rows per tile " + std::to_string(32 * p.groups) +
           ", tiles in flight " + std::to_string(p.depth) + ", grid " + std::to_string(p.grid_n) + " x " + std::to_string(p.grid_m);
  return "tokens per tile " + std::to_string(p.tokens) + ", warps " + std::to_string(p.ksplit) + ", row groups " +
         std::to_string(p.groups) + ", cluster " + std::to_string(p.cluster) + ", tiles in flight " + std::to_string(p.depth) +
         ", grid " + std::to_string(p.grid_n) + " x " + std::to_string(p.grid_m);
}

}  // namespace mxq::core
