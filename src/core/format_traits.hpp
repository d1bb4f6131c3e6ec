#pragma once
// Formats as compile-time traits, and the one runtime -> compile-time switch over them.
//
// A format is its element type, its block (group) size and its scale kind: an E8M0 power of two per
// block (the MX formats), or an E4M3 block scale under an fp32 tensor scale (NVFP4). Kernels and fast
// paths are templates over these traits; only a launcher turns a runtime Format into one of them.
#include <cstdint>
#include <type_traits>

#include <mxq/types.hpp>

#include "core/codec.hpp"

namespace mxq::core {

enum class ScaleKind : std::uint8_t {
  e8m0,         // MX: scale 2^e, one E8M0 byte per block
  e4m3_tensor,  // NVFP4: E4M3 block scale, fp32 tensor encode scale S
};

template <Format F>
struct FormatTraits;

template <Format F, ElemType ET, int BLOCK, ScaleKind SK>
struct FormatTraitsBase {
  static constexpr Format format = F;
  static constexpr ElemType elem = ET;
  static constexpr FloatSpec spec = Elem<ET>::spec;
  static constexpr int default_block = BLOCK;  // the format's group size (QuantOptions may override it)
  static constexpr ScaleKind scale = SK;
  static constexpr bool fp4 = spec.bits == 4;  // two codes per byte
  static constexpr bool nvfp4 = SK == ScaleKind::e4m3_tensor;
  static constexpr int code_bits = fp4 ? 4 : 8;  // bits a code occupies in the packed codes
};

template <> struct FormatTraits<Format::mxfp4> : FormatTraitsBase<Format::mxfp4, ElemType::e2m1, 32, ScaleKind::e8m0> {};
template <> struct FormatTraits<Format::mxfp6_e2m3> : FormatTraitsBase<Format::mxfp6_e2m3, ElemType::e2m3, 32, ScaleKind::e8m0> {};
template <> struct FormatTraits<Format::mxfp6_e3m2> : FormatTraitsBase<Format::mxfp6_e3m2, ElemType::e3m2, 32, ScaleKind::e8m0> {};
template <> struct FormatTraits<Format::mxfp8_e4m3> : FormatTraitsBase<Format::mxfp8_e4m3, ElemType::e4m3, 32, ScaleKind::e8m0> {};
template <> struct FormatTraits<Format::mxfp8_e5m2> : FormatTraitsBase<Format::mxfp8_e5m2, ElemType::e5m2, 32, ScaleKind::e8m0> {};
template <> struct FormatTraits<Format::mxint8> : FormatTraitsBase<Format::mxint8, ElemType::int8, 32, ScaleKind::e8m0> {};
template <> struct FormatTraits<Format::nvfp4> : FormatTraitsBase<Format::nvfp4, ElemType::e2m1, 16, ScaleKind::e4m3_tensor> {};

static_assert(FormatTraits<Format::nvfp4>::fp4 && FormatTraits<Format::nvfp4>::nvfp4,
              "NVFP4 packs two E2M1 codes per byte under an E4M3 block scale");
static_assert(!FormatTraits<Format::mxfp8_e4m3>::fp4, "8-bit formats store one code per byte");

// f is called with FormatTraits<F> (a default-constructed value of it) for the runtime format.
template <class Fn>
decltype(auto) dispatch_format(Format f, Fn&& fn) {
  switch (f) {
    case Format::mxfp4: return fn(FormatTraits<Format::mxfp4>{});
    case Format::mxfp6_e2m3: return fn(FormatTraits<Format::mxfp6_e2m3>{});
    case Format::mxfp6_e3m2: return fn(FormatTraits<Format::mxfp6_e3m2>{});
    case Format::mxfp8_e4m3: return fn(FormatTraits<Format::mxfp8_e4m3>{});
    case Format::mxfp8_e5m2: return fn(FormatTraits<Format::mxfp8_e5m2>{});
    case Format::mxint8: return fn(FormatTraits<Format::mxint8>{});
    case Format::nvfp4: break;
    case Format::nvfp4_e5m3:
      // Not a traits format: each backend that takes it does so before any dispatch (its own block code,
      // core/problem.hpp).
      throw Error(Error::Code::internal, "mxq: format nvfp4_e5m3 reached the traits dispatch");
  }
  return fn(FormatTraits<Format::nvfp4>{});
}

// ---- the amax scale rules as constants ---------------------------------------------------------------------
// floor, ceil, even, rceil and even_fp4 all have the form
//   e = floor_log2(amax) + ((sig + base + (lsb & (sig >> drop))) >> 24) - off,   sig = norm_sig24(amax)
// (a bump of 0 or 1 from the 24-bit significand, then the rule's offset):
//   floor: base 0,                 lsb 0, off emax            (no bump: sig < 2^24)
//   ceil:  base 2^23 - 1,          lsb 0, off emax            (bump unless sig == 2^23: amax a power of two)
//   even:  base 2^(drop-1) - 1,    lsb 1, off emax            (RNE of sig to mbits carries out of the binade)
//   rceil: base 2^24 - 1 - sig(M), lsb 0, off floor_log2(M)   (bump when sig > sig(M), M the largest element)
//   even_fp4: base 2^21,           lsb 0, off emax            (bump when sig >= 1.75 * 2^23: even at mbits 1)
// with drop = 23 - mbits. So a launcher resolves the rule into three numbers and the per-block work is
// the same few instructions for every rule. fastmath_test checks amax_rule_exp against mx_scale_exp for
// every rule, every MX element format and every significand at every binade.
struct AmaxRule {
  std::uint32_t base = 0, lsb = 0;
  int off = 0;
};
inline AmaxRule amax_rule(ScaleRule rule, const FloatSpec& f) {
  switch (rule) {
    case ScaleRule::ceil: return {0x7FFFFFu, 0u, f.emax};
    case ScaleRule::even: return {(1u << (22 - f.mbits)) - 1u, 1u, f.emax};
    case ScaleRule::even_fp4: return {1u << 21, 0u, f.emax};
    case ScaleRule::rceil: {
      const std::uint32_t mx = max_value_bits(f);
      return {0xFFFFFFu - norm_sig24(mx), 0u, floor_log2_bits(mx)};
    }
    default: return {0u, 0u, f.emax};  // floor (quest and qutlass_absmax do not use the amax rule)
  }
}
// The scale exponent of a finite block with amax bits a > 0 under rule constants k (format f).
template <int MBITS>
MXQ_HD_HOT int amax_rule_exp(const AmaxRule& k, std::uint32_t a) {
  const std::uint32_t sig = norm_sig24(a);
  const int bump = int((sig + k.base + (k.lsb & (sig >> (23 - MBITS)))) >> 24);
  return clamp_scale_exp(floor_log2_bits(a) + bump - k.off);
}

}  // namespace mxq::core
