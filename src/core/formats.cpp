// Names of enums, format facts and shape helpers.
#include <algorithm>
#include <array>
#include <string>
#include <vector>

#include <mxq/ops.hpp>

#include "core/codec.hpp"
#include "core/validate.hpp"

namespace mxq {
namespace {

template <class E, std::size_t N>
E parse_enum(std::string_view s, const std::array<E, N>& all, const char* what) {
  std::string names;
  for (E e : all) {
    if (to_string(e) == s) return e;
    names += (names.empty() ? "" : ", ") + std::string(to_string(e));
  }
  throw Error(Error::Code::invalid_argument,
              std::string("unknown ") + what + " '" + std::string(s) + "'; expected one of: " + names);
}

constexpr std::array kFormats{Format::mxfp4,      Format::mxfp6_e2m3, Format::mxfp6_e3m2, Format::mxfp8_e4m3,
                              Format::mxfp8_e5m2, Format::mxint8,     Format::nvfp4,
                              Format::nvfp4_e5m3};
constexpr std::array kRules{ScaleRule::floor, ScaleRule::ceil,  ScaleRule::even,           ScaleRule::rceil,
                            ScaleRule::even_fp4, ScaleRule::quest, ScaleRule::qutlass_absmax, ScaleRule::nvfp4,
                            ScaleRule::nvfp4_e5m3};
constexpr std::array kDTypes{DType::f32, DType::f16, DType::bf16, DType::u8, DType::i32, DType::i64};
constexpr std::array kBackends{Backend::automatic, Backend::reference, Backend::cpu, Backend::cuda};

// Which rules each format accepts (docs/numerics.md, "MX block scales"): floor, ceil, even and rceil
// are defined from the element's own emax, mbits and largest value, so for every MX format. The others
// come from one project each, for its formats only: even_fp4 is compressed-tensors' rule, which it
// computes for its MXFP4 and MXFP8 (E4M3) checkpoints; quest's constant 2.92247856 / 6 is the
// Gaussian-fitted clipping point of the E2M1 grid (QuTLASS's fusedQuantizeMx and fusedQuantizeNv, both
// E2M1); qutlass_absmax is QuTLASS's other E2M1 rule; nvfp4 is NVFP4's recipe; nvfp4_e5m3 the
// vllm-qdq-plugin's UE5M3 scale (no other rule is defined for a UE5M3 scale).
// NOTE: the amax rules first (amax_rules() is their prefix).
constexpr std::array kMxfp4Rules{ScaleRule::floor,    ScaleRule::ceil,  ScaleRule::even,          ScaleRule::rceil,
                                 ScaleRule::even_fp4, ScaleRule::quest, ScaleRule::qutlass_absmax};
constexpr std::array kMxfp8E4m3Rules{ScaleRule::floor, ScaleRule::ceil, ScaleRule::even, ScaleRule::rceil, ScaleRule::even_fp4};
constexpr std::array kMxRules{ScaleRule::floor, ScaleRule::ceil, ScaleRule::even, ScaleRule::rceil};
constexpr std::array kNvfp4Rules{ScaleRule::nvfp4, ScaleRule::quest};
constexpr std::array kNvfp4E5m3Rules{ScaleRule::nvfp4_e5m3};

// Why a rule is defined for the formats above and for no other: the reason a refusal gives.
std::string_view rule_scope(ScaleRule r) {
  switch (r) {
    case ScaleRule::floor:
    case ScaleRule::ceil:
    case ScaleRule::even:
    case ScaleRule::rceil: return "an E8M0 block scale from the element's own range";
    case ScaleRule::even_fp4: return "compressed-tensors' rule for its checkpoints";
    case ScaleRule::quest: return "its constant 2.92247856 / 6 fits the E2M1 grid";
    case ScaleRule::qutlass_absmax: return "QuTLASS's abs_max, whose elements are E2M1(3 x / 2^e)";
    case ScaleRule::nvfp4: return "NVFP4's recipe: an E4M3 block scale under an fp32 tensor scale";
    case ScaleRule::nvfp4_e5m3: return "the vllm-qdq-plugin's UE5M3 block scale RNE(amax / 6)";
  }
  return "?";
}

template <class T>
std::string names_of(std::span<const T> all) {
  std::string s;
  for (T e : all) s += (s.empty() ? "" : ", ") + std::string(to_string(e));
  return s;
}

}  // namespace

std::span<const Format> all_formats() { return kFormats; }
std::span<const ScaleRule> amax_rules() { return std::span<const ScaleRule>(kMxfp4Rules).first(5); }
std::span<const ScaleRule> rules_for(Format f) {
  switch (f) {
    case Format::mxfp4: return kMxfp4Rules;
    case Format::mxfp8_e4m3: return kMxfp8E4m3Rules;
    case Format::nvfp4: return kNvfp4Rules;
    case Format::nvfp4_e5m3: return kNvfp4E5m3Rules;
    default: return kMxRules;
  }
}

std::string rule_refusal(Format f, ScaleRule r) {
  const std::span<const ScaleRule> accepted = rules_for(f);
  if (std::find(accepted.begin(), accepted.end(), r) != accepted.end()) return {};
  std::vector<Format> defined_for;
  for (Format g : kFormats)
    for (ScaleRule a : rules_for(g))
      if (a == r) defined_for.push_back(g);
  const std::string fmt(to_string(f));
  return "rule '" + std::string(to_string(r)) + "' is not defined for format '" + fmt + "' (" +
         std::string(rule_scope(r)) + "; defined for " + names_of<Format>(defined_for) + "); " + fmt + " accepts " +
         names_of(accepted);
}

std::string_view to_string(Format f) {
  switch (f) {
    case Format::mxfp4: return "mxfp4";
    case Format::mxfp6_e2m3: return "mxfp6_e2m3";
    case Format::mxfp6_e3m2: return "mxfp6_e3m2";
    case Format::mxfp8_e4m3: return "mxfp8_e4m3";
    case Format::mxfp8_e5m2: return "mxfp8_e5m2";
    case Format::mxint8: return "mxint8";
    case Format::nvfp4: return "nvfp4";
    case Format::nvfp4_e5m3: return "nvfp4_e5m3";
  }
  return "?";
}
std::string_view to_string(ScaleRule r) {
  switch (r) {
    case ScaleRule::floor: return "floor";
    case ScaleRule::ceil: return "ceil";
    case ScaleRule::even: return "even";
    case ScaleRule::rceil: return "rceil";
    case ScaleRule::even_fp4: return "even_fp4";
    case ScaleRule::quest: return "quest";
    case ScaleRule::qutlass_absmax: return "qutlass_absmax";
    case ScaleRule::nvfp4: return "nvfp4";
    case ScaleRule::nvfp4_e5m3: return "nvfp4_e5m3";
  }
  return "?";
}
std::string_view to_string(Rounding r) { return r == Rounding::nearest_even ? "rne" : "stochastic"; }
std::string_view to_string(Rotation r) {
  return r == Rotation::none ? "none" : r == Rotation::hadamard ? "hadamard" : r == Rotation::random_hadamard ? "random_hadamard" : "matrix";
}
std::string_view to_string(MatrixPrecision m) { return m == MatrixPrecision::exact ? "exact" : "bf16"; }
std::pair<Rotation, int> parse_rotation(std::string_view s) {
  const auto bad = [&]() -> std::pair<Rotation, int> {
    throw Error(Error::Code::invalid_argument, "mxq: rotation '" + std::string(s) +
                                                   "': expected none, had<RS> or rhad<RS> with RS 16, 32, 64, 128 or 256");
  };
  if (s == "none") return {Rotation::none, 0};
  Rotation r = Rotation::hadamard;
  std::string_view n;
  if (s.starts_with("rhad")) r = Rotation::random_hadamard, n = s.substr(4);
  else if (s.starts_with("had")) n = s.substr(3);
  else return bad();
  if (n.empty() || n.size() > 3 || n.find_first_not_of("0123456789") != std::string_view::npos) return bad();
  const int rs = std::stoi(std::string(n));
  if (rs < 16 || rs > 256 || (rs & (rs - 1))) return bad();
  return {r, rs};
}
std::string_view to_string(ScaleLayout l) { return l == ScaleLayout::linear ? "linear" : "swizzled"; }
std::string_view to_string(DType t) {
  switch (t) {
    case DType::f32: return "f32";
    case DType::f16: return "f16";
    case DType::bf16: return "bf16";
    case DType::u8: return "u8";
    case DType::i32: return "i32";
    case DType::i64: return "i64";
  }
  return "?";
}
std::string_view to_string(Backend b) {
  switch (b) {
    case Backend::automatic: return "auto";
    case Backend::reference: return "reference";
    case Backend::cpu: return "cpu";
    case Backend::cuda: return "cuda";
  }
  return "?";
}
std::string_view to_string(ElemType t) {
  switch (t) {
    case ElemType::e2m1: return "e2m1";
    case ElemType::e2m3: return "e2m3";
    case ElemType::e3m2: return "e3m2";
    case ElemType::e4m3: return "e4m3";
    case ElemType::e5m2: return "e5m2";
    case ElemType::int8: return "int8";
  }
  return "?";
}

Format parse_format(std::string_view s) { return parse_enum(s, kFormats, "format"); }
ScaleRule parse_rule(std::string_view s) { return parse_enum(s, kRules, "scale rule"); }
DType parse_dtype(std::string_view s) { return parse_enum(s, kDTypes, "dtype"); }
Backend parse_backend(std::string_view s) { return parse_enum(s, kBackends, "backend"); }

FormatInfo format_info(Format f) {
  auto mk = [&](ElemType t, int group, bool e8m0) {
    const core::FloatSpec s = core::elem_spec(t);
    return FormatInfo{f, t, s.bits, group, core::u2f(core::max_value_bits(s)), s.emax, s.mbits, e8m0};
  };
  switch (f) {
    case Format::mxfp4: return mk(ElemType::e2m1, 32, true);
    case Format::mxfp6_e2m3: return mk(ElemType::e2m3, 32, true);
    case Format::mxfp6_e3m2: return mk(ElemType::e3m2, 32, true);
    case Format::mxfp8_e4m3: return mk(ElemType::e4m3, 32, true);
    case Format::mxfp8_e5m2: return mk(ElemType::e5m2, 32, true);
    case Format::mxint8: return mk(ElemType::int8, 32, true);
    case Format::nvfp4: return mk(ElemType::e2m1, 16, false);
    case Format::nvfp4_e5m3: return mk(ElemType::e2m1, 16, false);
  }
  throw Error(Error::Code::invalid_argument, "unknown format value " + std::to_string(int(f)));
}

int group_size(const QuantOptions& o) { return o.group_size ? o.group_size : format_info(o.format).default_group; }

std::int64_t code_cols(Format f, std::int64_t K) {
  return format_info(f).elem_bits == 4 ? (K + 1) / 2 : K;
}

Shape2 scale_shape(const QuantOptions& o, std::int64_t rows, std::int64_t K) {
  const std::int64_t g = group_size(o);
  const std::int64_t c = (K + g - 1) / g;
  if (o.scale_layout == ScaleLayout::linear) return {rows, c};
  return {(rows + 127) / 128 * 128, (c + 3) / 4 * 4};
}

Shape2 clip_mask_shape(std::int64_t rows, std::int64_t K) { return {rows, (K + 7) / 8}; }

float nvfp4_tensor_scale_from_amax(float amax) { return core::nvfp4_encode_scale(amax); }

}  // namespace mxq
