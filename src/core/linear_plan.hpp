#pragma once
// The W4A16 linear's static tile table (docs/linear.md), per (architecture, M, N, K). Host code only.
#include <cstdint>
#include <cstdlib>
#include <string>
#include <string_view>

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
// The sm90a kernel's tiles (w4a16_wgmma.cuh): BM tokens x 128 * strips rows of W per CTA, K split over a
// cluster of ksplit CTAs or not; the first row whose M range holds M and that gives >= kWgmmaMinCtas
// CTAs is taken, else the mma.sync tiles above. Probe (dev/probes/wgmma_probe.cu, H100): 128 x 256 over
// the whole of K with the shared-memory epilogue was the fastest tile from M = 100 to 4096 wherever it gave
// >= 100 CTAs; where it gives fewer, the same tile with K split over 2 CTAs (8192^2 at M = 256: 82 us
// against 109 for 128 x 128, 14336 x 4096 at M = 128: 48 against 60), and at M = 33..128 64 x 256 split
// over 2 CTAs (14336 x 4096 and 28672 x 8192 at M = 64: 1.2-1.25x the x-staged mma.sync tile; 8192^2 at
// M = 128: 57 against 76 us); 128 x 128 split over 2 for M > 128 and 64 x 128 for M <= 128 where only
// they give 100 CTAs. Deeper x and weight rings (up to 10 and 8 tiles) and 4-CTA clusters measured no
// faster. The 64-token tiles take their weights through a 6-slot cp.async ring in shared memory (wsmem:
// 28672 x 8192 at M = 64 94.5 against 106.1 us, 8192^2 at M = 128 50.1 against 54.8); the 128-token
// tiles keep the 4-tile register ring (8192^2 at M = 1024 245 us against 257 through shared memory).
struct WgmmaKernelRow {
  int bm, strips, stages, prefetch;
  bool smem_epilogue;
  int ksplit;             // CTAs of a cluster splitting K (the plan's cluster)
  std::int64_t min_m, max_m;  // the rows of x it is for
  int raw = 3;            // x tiles the tensor copies keep in flight
  int wait = 1;           // k16 wgmma groups left in flight when the next one is issued
  bool wsmem = false;     // the weights through a cp.async ring in shared memory (prefetch slots per warp)
  constexpr bool matches(const LinearPlan& p) const {
    return p.wgmma && bm == p.tokens && 4 * strips == p.groups && prefetch == p.depth && ksplit == p.cluster;
  }
};
constexpr WgmmaKernelRow kWgmmaKernels[] = {
    {128, 2, 4, 4, true, 1, 65, INT64_MAX},
    {128, 2, 4, 4, false, 2, 65, INT64_MAX},
    {64, 2, 6, 6, false, 2, 33, 128, 3, 1, true},
    {128, 1, 4, 4, false, 2, 129, INT64_MAX},
    {64, 1, 6, 6, false, 2, 33, 128, 3, 1, true}};
// Each row is launched by the fields matches() compares: no two rows may share them.
constexpr bool wgmma_rows_distinct() {
  for (const WgmmaKernelRow& a : kWgmmaKernels)
    for (const WgmmaKernelRow& b : kWgmmaKernels)
      if (&a != &b && a.bm == b.bm && a.strips == b.strips && a.prefetch == b.prefetch && a.ksplit == b.ksplit) return false;
  return true;
}
static_assert(wgmma_rows_distinct(), "kWgmmaKernels: two rows with the same tokens, strips, prefetch and K split");
constexpr int kWgmmaMinCtas = 100;  // below this many CTAs the mma.sync tiles are faster (probe, H100)

// MXQ_LINEAR_NO_WGMMA (set, not "0") keeps the mma.sync tiles where the sm90a kernel would run; read at
// each call (the tests switch it) by cuda::linear and mxq::linear_plan alike.
inline bool wgmma_disabled_by_env() {
  const char* v = std::getenv("MXQ_LINEAR_NO_WGMMA");
  return v && *v && std::string_view(v) != "0";
}

// wgmma_ok: the library holds sm_90a code and the device runs it (cuda/gemm/linear_launch.cu).
inline LinearPlan plan_linear(std::int64_t N, std::int64_t K, std::int64_t M, int sm, bool wgmma_ok = false) {
  LinearPlan p{};
  const std::int64_t pairs_ = (N + 31) / 32;
  if (wgmma_ok && sm == 90) {
    for (const WgmmaKernelRow& r : kWgmmaKernels) {
      const std::int64_t tiles_n = (pairs_ + 4 * r.strips - 1) / (4 * r.strips);
      if (M < r.min_m || M > r.max_m || tiles_n * r.ksplit * ((M + r.bm - 1) / r.bm) < kWgmmaMinCtas) continue;
      p.wgmma = true;
      p.tokens = r.bm;
      p.groups = 4 * r.strips;
      p.depth = r.prefetch;
      p.ksplit = 8;
      p.cluster = r.ksplit;
      p.xstage = false;
      p.sm = sm;
      p.grid_n = tiles_n * r.ksplit;
      p.grid_m = (M + p.tokens - 1) / p.tokens;
      return p;
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
// The row of kWgmmaKernels a wgmma plan launches, or nullptr.
inline const WgmmaKernelRow* wgmma_row(const LinearPlan& p) {
  for (const WgmmaKernelRow& r : kWgmmaKernels)
    if (r.matches(p)) return &r;
  return nullptr;
}

inline bool has_kernel(const LinearPlan& p) {
  if (p.wgmma) return wgmma_row(p) != nullptr;
  for (const LinearKernelRow& r : kLinearKernels)
    if (r.matches(p)) return true;
  return false;
}

inline std::string to_string(const LinearPlan& p) {
  if (p.wgmma) {
    const WgmmaKernelRow* r = wgmma_row(p);
    const bool wsmem = r && r->wsmem;  // the weight ring: depth slots in shared memory (depth - 1 tiles ahead), or registers
    return "wgmma (sm90a), tokens per tile " + std::to_string(p.tokens) + ", weight rows per tile " + std::to_string(32 * p.groups) +
           (wsmem ? ", weights through a shared-memory ring of " + std::to_string(p.depth) + " tiles"
                  : ", tiles in flight " + std::to_string(p.depth)) +
           ", K split over " + std::to_string(p.cluster) + (p.cluster == 1 ? " CTA" : " CTAs") + ", grid " + std::to_string(p.grid_n) +
           " x " + std::to_string(p.grid_m);
  }
  return "tokens per tile " + std::to_string(p.tokens) + ", warps " + std::to_string(p.ksplit) + ", row groups " +
         std::to_string(p.groups) + ", cluster " + std::to_string(p.cluster) + ", tiles in flight " + std::to_string(p.depth) +
         ", grid " + std::to_string(p.grid_n) + " x " + std::to_string(p.grid_m);
}

}  // namespace mxq::core
