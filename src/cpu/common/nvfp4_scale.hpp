#pragma once
// NVFP4's block scales under the tensor encode scale S: the per-call tables (scale values, element
// multipliers) and the scale codes of eight blocks, shared by quantize, QDQ and dequantize.
#include "cpu/common/tiles.hpp"

namespace mxq::cpu {
namespace {

using namespace mxq::core;

// NVFP4 per-call tables: for every E4M3 scale byte its value (NaN codes: 0) and the element multiplier
// nvfp4_multiplier (0 for a zero scale).
struct NvTables {
  float sval[256], m[256];
};
inline NvTables make_nv_tables(float S) {
  NvTables t{};
  for (int c = 0; c < 256; ++c) {
    const bool nan = (c & 0x7F) == kE4M3NaN;
    t.sval[c] = nan ? 0.0f : decode_f32(std::uint32_t(c), kE4M3);
    t.m[c] = (nan || c > 0x7F) ? 0.0f : nvfp4_multiplier(std::uint32_t(c), S);
  }
  return t;
}

// The scale codes of eight full NVFP4 blocks of bf16/fp32 storage (128 elements): each block's amax
// and nvfp4_block_scale_code (e4m3_code_rne_sat of amax * S / 6), a step at a time across the eight
// blocks so that each step vectorises (the division among them). ok[j]: all ones where block j is
// finite, else 0 (a NaN or Inf: the NaN scale); sc[j]: the code, 0 where not finite.
template <DType DT>
MXQ_INLINE void nvfp4_scale_codes8(const Storage<DT>* s, float S, std::uint32_t* sc, std::uint32_t* ok) {
  alignas(64) std::uint32_t xb[128], am[8];
  for (int i = 0; i < 128; ++i)
    xb[i] = (DT == DType::f32 ? std::uint32_t(s[i]) : std::uint32_t(s[i]) << 16) & 0x7FFFFFFFu;
  for (int j = 0; j < 8; ++j) {
    std::uint32_t a = 0;
    for (int i = 0; i < 16; ++i) a = std::max(a, xb[16 * j + i]);
    am[j] = a;
  }
  for (int j = 0; j < 8; ++j) sc[j] = e4m3_code_rne_sat(div_rn(mul_rn(u2f(am[j]), S), 6.0f));
  for (int j = 0; j < 8; ++j) {
    ok[j] = 0u - std::uint32_t(am[j] < 0x7F800000u);
    sc[j] &= ok[j];
  }
}

}  // namespace
}  // namespace mxq::cpu
