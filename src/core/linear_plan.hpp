#pragma once
// The W4A16 linear's static tile table (docs/linear.md): one row per M range, the same on every
// architecture in this version. Host code only.
#include <cstdint>

namespace mxq::core {

struct LinearPlan {
  int tokens;           // tokens (rows of x) per CTA tile: the mma's n side, 8, 16, 32 or 64
  int ksplit;           // warps of a CTA, each summing its share of K; reduced in shared memory in warp order
  int depth;            // 64-column weight tiles each warp keeps in flight
  std::int64_t grid_n;  // CTAs along N: 32 weight rows each
  std::int64_t grid_m;  // CTAs along M
};

inline LinearPlan plan_linear(std::int64_t N, std::int64_t /*K*/, std::int64_t M) {
  LinearPlan p;
  p.tokens = M <= 8 ? 8 : M <= 16 ? 16 : M <= 32 ? 32 : 64;
  p.ksplit = 8;
  p.grid_n = (N + 31) / 32;
  // NOTE: fewer than 256 CTAs leave an SM one CTA (8 warps): a ring of 8 tiles per warp keeps 64 KB of
  // weights in flight per SM, as two CTAs of 4-tile rings do (Little's law: ~33 KB per SM at 3.6 TB/s).
  p.depth = p.tokens <= 16 && p.grid_n < 256 ? 8 : 4;
  p.grid_m = (M + p.tokens - 1) / p.tokens;
  return p;
}

}  // namespace mxq::core
