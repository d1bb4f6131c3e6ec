// Bad input at the API boundary: every error names the argument and what was expected, and nothing
// is written when validation fails.
#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <vector>

#include <gtest/gtest.h>

#if defined(__x86_64__) || defined(__i386__)
#include <xmmintrin.h>
#endif

#include "helpers.hpp"

using namespace mxq;
using th::HostTensor;
using th::Quantized;

namespace {

// Runs f, expects an mxq::Error with the given code whose message contains every fragment.
template <class F>
void expect_error(F&& f, Error::Code code, std::initializer_list<const char*> fragments) {
  try {
    f();
    ADD_FAILURE() << "expected an mxq::Error";
  } catch (const Error& e) {
    EXPECT_EQ(int(e.code()), int(code)) << e.what();
    for (const char* s : fragments) EXPECT_NE(std::string(e.what()).find(s), std::string::npos) << "'" << s << "' not in: " << e.what();
  }
}

struct Fixture {
  HostTensor x = th::llm_like(DType::bf16, 4, 64, 1);
  QuantOptions o = QuantOptions::mx(Format::mxfp4, ScaleRule::floor);
  Quantized q{o, 4, 64, true};
};

}  // namespace

TEST(Api, WrongOutputShapesNameTheArgument) {
  Fixture f;
  QuantizedOut out = f.q.out();
  out.codes.cols = 31;
  expect_error([&] { quantize(f.x.view(), out, f.o); }, Error::Code::invalid_argument,
               {"mxq::quantize", "'codes'", "[4, 31]", "expected [4, 32]"});
  out = f.q.out();
  out.scales.rows = 3;
  expect_error([&] { quantize(f.x.view(), out, f.o); }, Error::Code::invalid_argument, {"'scales'", "expected [4, 2]"});
  out = f.q.out();
  out.clip_mask.cols = 7;
  expect_error([&] { quantize(f.x.view(), out, f.o); }, Error::Code::invalid_argument, {"'clip_mask'", "expected [4, 8]"});
  // Swizzled scales must be padded to [128, 4].
  QuantOptions sw = f.o;
  sw.scale_layout = ScaleLayout::swizzled;
  expect_error([&] { quantize(f.x.view(), f.q.out(), sw); }, Error::Code::invalid_argument, {"'scales'", "expected [128, 4]"});
}

TEST(Api, WrongDtypesAndStrides) {
  Fixture f;
  QuantizedOut out = f.q.out();
  out.codes.dtype = DType::f32;
  expect_error([&] { quantize(f.x.view(), out, f.o); }, Error::Code::invalid_argument, {"'codes'", "dtype f32", "expected u8"});
  Tensor xu = f.x.view();
  xu.dtype = DType::u8;
  expect_error([&] { quantize(xu, f.q.out(), f.o); }, Error::Code::invalid_argument, {"'x'", "expected f32, f16 or bf16"});
  Tensor xs = f.x.view();
  xs.row_stride = 10;
  expect_error([&] { quantize(xs, f.q.out(), f.o); }, Error::Code::invalid_argument, {"'x'", "row_stride 10", ">= cols (64)"});
  HostTensor y(DType::f32, 4, 64);
  expect_error([&] { qdq(f.x.view(), y.view(), f.o); }, Error::Code::invalid_argument, {"mxq::qdq", "'y'", "dtype f32", "expected bf16"});
  Tensor neg = f.x.view();
  neg.rows = -1;
  expect_error([&] { qdq(neg, neg, f.o); }, Error::Code::invalid_argument, {"negative shape"});
}

TEST(Api, NullAndOverlappingBuffers) {
  Fixture f;
  QuantizedOut out = f.q.out();
  out.codes.data = nullptr;
  expect_error([&] { quantize(f.x.view(), out, f.o); }, Error::Code::invalid_argument, {"'codes'", "null"});
  Tensor xn = f.x.view();
  xn.data = nullptr;
  expect_error([&] { quantize(xn, f.q.out(), f.o); }, Error::Code::invalid_argument, {"'x'", "null"});
  // codes placed inside x
  out = f.q.out();
  out.codes.data = f.x.bytes.data() + 8;
  expect_error([&] { quantize(f.x.view(), out, f.o); }, Error::Code::invalid_argument, {"'codes' overlaps input 'x'"});
  // scales inside codes
  out = f.q.out();
  out.scales.data = f.q.codes.bytes.data();
  expect_error([&] { quantize(f.x.view(), out, f.o); }, Error::Code::invalid_argument, {"'codes'", "'scales'", "overlap"});
  // qdq: partial overlap refused, exact aliasing allowed
  HostTensor big(DType::bf16, 5, 64);
  Tensor a = Tensor::of(big.bytes.data(), DType::bf16, 4, 64), b = Tensor::of(big.bytes.data() + 128, DType::bf16, 4, 64);
  expect_error([&] { qdq(a, b, f.o); }, Error::Code::invalid_argument, {"'y' overlaps input 'x'"});
  EXPECT_NO_THROW(qdq(a, a, f.o));
}

TEST(Api, OptionsAreValidated) {
  Fixture f;
  auto q = [&](QuantOptions o) { quantize(f.x.view(), f.q.out(), o); };
  QuantOptions o = f.o;
  o.group_size = 24;
  expect_error([&] { q(o); }, Error::Code::invalid_argument, {"'group_size'", "24", "power of two"});
  o.group_size = 512;
  expect_error([&] { q(o); }, Error::Code::invalid_argument, {"'group_size'"});
  o = f.o;
  o.tensor_scale = 2.0f;
  expect_error([&] { q(o); }, Error::Code::invalid_argument, {"'tensor_scale'", "only used by format nvfp4"});
  for (float bad : {0.0f, -1.0f, INFINITY, NAN}) {
    QuantOptions n = QuantOptions::nvfp4(bad);
    Quantized qn(n, 4, 64);
    expect_error([&] { quantize(f.x.view(), qn.out(), n); }, Error::Code::invalid_argument, {"'tensor_scale'", "finite value > 0"});
  }
  // NVFP4 dequantize needs S.
  QuantOptions n = QuantOptions::nvfp4();
  Quantized qn(n, 4, 64);
  HostTensor y(DType::f32, 4, 64);
  expect_error([&] { dequantize(qn.in(), y.view(), n); }, Error::Code::invalid_argument, {"mxq::dequantize", "'tensor_scale'"});
  o = f.o;
  o.format = static_cast<Format>(42);
  expect_error([&] { q(o); }, Error::Code::invalid_argument, {"'format'", "invalid value 42"});
}

// The format x rule table, decided from each rule's definition and its source (docs/api.md, "Formats x
// scale rules"; docs/numerics.md), written out here rather than read from rules_for: floor, ceil, even
// and rceil are defined by the element's own emax, mbits and largest value, so for every MX format;
// even_fp4 is compressed-tensors' rule, which it computes for MXFP4 and MXFP8 E4M3 only; quest's
// constant 2.92247856 / 6 is the clipping point of the E2M1 grid (QuTLASS: MXFP4 and NVFP4);
// qutlass_absmax is QuTLASS's MXFP4 rule; nvfp4 is NVFP4's recipe; nvfp4_e5m3 the vllm-qdq-plugin's UE5M3
// scale, its format's only rule.
namespace {
bool defined(Format f, ScaleRule r) {
  const bool mx = f != Format::nvfp4 && f != Format::nvfp4_e5m3;
  switch (r) {
    case ScaleRule::floor:
    case ScaleRule::ceil:
    case ScaleRule::even:
    case ScaleRule::rceil: return mx;
    case ScaleRule::even_fp4: return f == Format::mxfp4 || f == Format::mxfp8_e4m3;
    case ScaleRule::quest: return f == Format::mxfp4 || f == Format::nvfp4;
    case ScaleRule::qutlass_absmax: return f == Format::mxfp4;
    case ScaleRule::nvfp4: return f == Format::nvfp4;
    case ScaleRule::nvfp4_e5m3: return f == Format::nvfp4_e5m3;
  }
  return false;
}
}  // namespace

// Every format x every rule: the catalogue lists exactly the defined pairs; quantize, QDQ and
// dequantize accept those and refuse the others with an error naming the pair and the rules the
// format accepts, writing nothing.
TEST(Api, RulesAFormatDoesNotDefineAreRefused) {
  const HostTensor x = th::llm_like(DType::bf16, 4, 64, 3);
  int refused = 0;
  for (Format f : all_formats())
    for (int ri = 0; ri <= int(ScaleRule::nvfp4_e5m3); ++ri) {
      const ScaleRule r = static_cast<ScaleRule>(ri);
      const std::string what = std::string(to_string(f)) + "/" + std::string(to_string(r));
      const auto rules = rules_for(f);
      EXPECT_EQ(std::find(rules.begin(), rules.end(), r) != rules.end(), defined(f, r)) << what;
      EXPECT_EQ(rule_refusal(f, r).empty(), defined(f, r)) << what;
      QuantOptions o = f == Format::nvfp4 ? QuantOptions::nvfp4(2.0f) : QuantOptions::mx(f, r);
      o.rule = r;
      if (f == Format::nvfp4 && r == ScaleRule::quest) o.tensor_scale.reset();  // its tensor scale is 1
      Quantized q(o, 4, 64);
      HostTensor y(DType::bf16, 4, 64), z(DType::f32, 4, 64);
      if (defined(f, r)) {
        EXPECT_NO_THROW(quantize(x.view(), q.out(), o)) << what;
        EXPECT_NO_THROW(qdq(x.view(), y.view(), o)) << what;
        EXPECT_NO_THROW(dequantize(q.in(), z.view(), o)) << what;
        continue;
      }
      ++refused;
      const std::string why = "option 'rule': " + rule_refusal(f, r);
      expect_error([&] { quantize(x.view(), q.out(), o); }, Error::Code::invalid_argument, {("mxq::quantize: " + why).c_str()});
      expect_error([&] { qdq(x.view(), y.view(), o); }, Error::Code::invalid_argument, {("mxq::qdq: " + why).c_str()});
      expect_error([&] { dequantize(q.in(), z.view(), o); }, Error::Code::invalid_argument, {("mxq::dequantize: " + why).c_str()});
      for (const HostTensor* t : {&q.codes, &q.scales, &y, &z})
        EXPECT_TRUE(std::all_of(t->bytes.begin(), t->bytes.end(), [](std::uint8_t b) { return b == 0xA5; })) << what << ": written";
    }
  EXPECT_EQ(refused, 8 * 9 - 31);  // 31 pairs defined: 6 MX formats x 4, even_fp4 x 2, quest x 2, qutlass_absmax, nvfp4,
                                   // nvfp4_e5m3
}

// The whole message of each kind of refusal.
TEST(Api, RuleRefusalsNameTheFormatTheRuleAndTheAcceptedRules) {
  const HostTensor x = th::llm_like(DType::bf16, 2, 64, 4);
  HostTensor y(DType::bf16, 2, 64);
  const auto message = [&](Format f, ScaleRule r) {
    QuantOptions o = QuantOptions::mx(f, r);
    try {
      qdq(x.view(), y.view(), o);
    } catch (const Error& e) {
      return std::string(e.what());
    }
    return std::string("accepted");
  };
  EXPECT_EQ(message(Format::mxint8, ScaleRule::quest),
            "mxq::qdq: option 'rule': rule 'quest' is not defined for format 'mxint8' (its constant 2.92247856 / 6 fits the "
            "E2M1 grid; defined for mxfp4, nvfp4); mxint8 accepts floor, ceil, even, rceil");
  EXPECT_EQ(message(Format::mxfp8_e4m3, ScaleRule::quest),
            "mxq::qdq: option 'rule': rule 'quest' is not defined for format 'mxfp8_e4m3' (its constant 2.92247856 / 6 fits "
            "the E2M1 grid; defined for mxfp4, nvfp4); mxfp8_e4m3 accepts floor, ceil, even, rceil, even_fp4");
  EXPECT_EQ(message(Format::mxfp8_e5m2, ScaleRule::even_fp4),
            "mxq::qdq: option 'rule': rule 'even_fp4' is not defined for format 'mxfp8_e5m2' (compressed-tensors' rule for "
            "its checkpoints; defined for mxfp4, mxfp8_e4m3); mxfp8_e5m2 accepts floor, ceil, even, rceil");
  EXPECT_EQ(message(Format::mxfp8_e4m3, ScaleRule::qutlass_absmax),
            "mxq::qdq: option 'rule': rule 'qutlass_absmax' is not defined for format 'mxfp8_e4m3' (QuTLASS's abs_max, whose "
            "elements are E2M1(3 x / 2^e); defined for mxfp4); mxfp8_e4m3 accepts floor, ceil, even, rceil, even_fp4");
  EXPECT_EQ(message(Format::mxfp4, ScaleRule::nvfp4),
            "mxq::qdq: option 'rule': rule 'nvfp4' is not defined for format 'mxfp4' (NVFP4's recipe: an E4M3 block scale "
            "under an fp32 tensor scale; defined for nvfp4); mxfp4 accepts floor, ceil, even, rceil, even_fp4, quest, "
            "qutlass_absmax");
  EXPECT_EQ(message(Format::nvfp4, ScaleRule::even),
            "mxq::qdq: option 'rule': rule 'even' is not defined for format 'nvfp4' (an E8M0 block scale from the element's "
            "own range; defined for mxfp4, mxfp6_e2m3, mxfp6_e3m2, mxfp8_e4m3, mxfp8_e5m2, mxint8); nvfp4 accepts nvfp4, quest");
}

// NVFP4 under rule quest: its tensor scale is 1 (another given one is refused; dequantize needs none);
// the fused producers refuse it.
TEST(Api, Nvfp4Quest) {
  const HostTensor x = th::llm_like(DType::bf16, 4, 64, 2);
  QuantOptions o = QuantOptions::nvfp4(2.0f);
  o.rule = ScaleRule::quest;
  Quantized q(o, 4, 64);
  expect_error([&] { quantize(x.view(), q.out(), o); }, Error::Code::invalid_argument,
               {"'tensor_scale'", "rule 'quest'", "tensor scale is 1"});
  o.tensor_scale = 1.0f;  // the one it uses: accepted
  quantize(x.view(), q.out(), o);
  EXPECT_EQ(q.S, 1.0f);
  o.tensor_scale.reset();
  HostTensor y(DType::f32, 4, 64), y1(DType::f32, 4, 64);
  dequantize(q.in(), y.view(), o);  // no tensor_scale needed
  o.tensor_scale = 1.0f;
  dequantize(q.in(), y1.view(), o);
  EXPECT_EQ(y.bytes, y1.bytes);
  o.tensor_scale.reset();
  HostTensor w(DType::bf16, 1, 64), out(DType::bf16, 4, 64);
  for (int k = 0; k < 64; ++k) w.set(0, k, 1.0f);
  expect_error([&] { rms_norm(x.view(), w.view(), 1e-6f, out.view(), &o); }, Error::Code::unsupported,
               {"nvfp4 with rule 'quest'", "fused producer"});
  expect_error([&] { silu_mul(x.view(), x.view(), out.view(), &o); }, Error::Code::unsupported,
               {"nvfp4 with rule 'quest'", "fused producer"});
}

// A finite NVFP4 block whose quest statistic is NaN (the fp32 sums overflow to both infinities) is a
// non-finite block on both CPU backends: scale 0x7F, codes 0, mask 0, NaN on dequantize and QDQ. It sits
// in a row of ordinary blocks after one whose squares overflow (a +Inf statistic: a finite block of
// scale 448); K = 256 puts it inside a chunk of eight blocks (the CPU's AVX2 path) and K = 32 after
// none; with and without the clip mask (which takes the staged path); every output equal to the
// reference's bytes.
TEST(Api, Nvfp4QuestNanStatisticIsANonFiniteBlock) {
  for (std::int64_t K : {32, 256})
    for (DType dt : {DType::f32, DType::bf16})
      for (bool sr : {false, true})
        for (bool with_mask : {true, false}) {
          const std::int64_t nb = 1 + (K > 32 ? 3 : 0);  // the NaN block's index (1 or 4)
          HostTensor x(dt, 1, K);
          for (int k = 0; k < K; ++k) x.set(0, k, float((k * 7) % 23 - 11) * 0.25f);
          for (int k = 0; k < 16; ++k) x.set(0, 16 * nb + k, k % 4 < 2 ? 3e38f : -3e38f);
          // the block before: pair sums 0, squares overflow: a +Inf statistic, a finite block (scale 448)
          for (int k = 0; k < 16; ++k) x.set(0, 16 * (nb - 1) + k, k % 2 ? -3e38f : 3e38f);
          std::vector<std::uint8_t> ref_codes, ref_scales, ref_mask, ref_z;
          for (Backend be : {Backend::reference, Backend::cpu}) {
            QuantOptions o = QuantOptions::nvfp4();
            o.rule = ScaleRule::quest;
            o.backend = be;
            if (sr) o.rounding = Rounding::stochastic;
            Quantized q(o, 1, K, with_mask);
            quantize(x.view(), q.out(), o);
            const std::string what = std::string(to_string(be)) + " K " + std::to_string(K) + (sr ? " sr" : " rne") + (with_mask ? " mask" : "");
            EXPECT_EQ(q.scale(0, nb), 0x7Fu) << what;
            EXPECT_EQ(q.scale(0, nb - 1), 0x7Eu) << what;
            for (int k = 0; k < 16; ++k) {
              EXPECT_EQ(q.code(0, 16 * nb + k), 0u) << what << " " << k;
              if (with_mask) EXPECT_EQ((q.mask.bytes[(16 * nb + k) / 8] >> (k % 8)) & 1, 0) << what << " " << k;
            }
            for (std::int64_t b = 0; b < K / 16; ++b)
              if (b != nb) EXPECT_NE(q.scale(0, b), 0x7Fu) << what << " block " << b;
            HostTensor y(dt, 1, K), z(dt, 1, K);
            dequantize(q.in(), y.view(), o);
            qdq(x.view(), z.view(), o);
            for (int k = 0; k < 16; ++k) {
              EXPECT_TRUE(std::isnan(y.get(0, 16 * nb + k))) << what << " " << k;
              EXPECT_TRUE(std::isnan(z.get(0, 16 * nb + k))) << what << " " << k;
            }
            EXPECT_EQ(y.bytes, z.bytes) << what;  // QDQ = dequantize(quantize), NaN bits included
            if (be == Backend::reference) {
              ref_codes = q.codes.bytes, ref_scales = q.scales.bytes, ref_mask = q.mask.bytes, ref_z = z.bytes;
            } else {
              EXPECT_EQ(q.codes.bytes, ref_codes) << what;
              EXPECT_EQ(q.scales.bytes, ref_scales) << what;
              EXPECT_EQ(q.mask.bytes, ref_mask) << what;
              EXPECT_EQ(z.bytes, ref_z) << what;
            }
          }
        }
}

TEST(Api, NothingIsWrittenWhenValidationFails) {
  Fixture f;
  const auto before = f.q.codes.bytes;
  QuantizedOut out = f.q.out();
  out.scales.cols = 99;
  EXPECT_THROW(quantize(f.x.view(), out, f.o), Error);
  EXPECT_EQ(f.q.codes.bytes, before);
}

TEST(Api, BackendSelection) {
  Fixture f;
  QuantOptions o = f.o;
  o.backend = Backend::cuda;
  expect_error([&] { quantize(f.x.view(), f.q.out(), o); }, Error::Code::backend_unavailable, {"cuda"});
  // Data on a CUDA device is never silently copied to the host.
  Tensor xd = f.x.view();
  xd.device = Device::cuda;
  std::string why_not;
  if (!cuda_compiled())
    expect_error([&] { tensor_amax(xd); }, Error::Code::backend_unavailable, {"CUDA device", "no CUDA backend"});
  else if (!cuda_available(&why_not))
    expect_error([&] { tensor_amax(xd); }, Error::Code::backend_unavailable, {"CUDA device", "cannot run"});
  else  // a host pointer marked as device memory is caught before any kernel touches it
    expect_error([&] { tensor_amax(xd); }, Error::Code::invalid_argument, {"'x'", "host memory"});
  o.backend = Backend::cpu;
  expect_error([&] { tensor_amax(xd, Backend::cpu); }, Error::Code::backend_unavailable, {"needs data on the CPU"});
  // Views on different devices.
  QuantizedOut out = f.q.out();
  out.codes.device = Device::cuda;
  expect_error([&] { quantize(f.x.view(), out, f.o); }, Error::Code::invalid_argument, {"'codes' is on cuda"});
  // The environment variable forces a backend for automatic requests.
  EXPECT_EQ(choose_backend(Backend::automatic, Device::cpu).backend, Backend::cpu);
  setenv("MXQ_BACKEND", "reference", 1);
  EXPECT_EQ(choose_backend(Backend::automatic, Device::cpu).backend, Backend::reference);
  EXPECT_NE(choose_backend(Backend::automatic, Device::cpu).reason.find("MXQ_BACKEND"), std::string::npos);
  setenv("MXQ_BACKEND", "gpu", 1);
  expect_error([&] { choose_backend(Backend::automatic, Device::cpu); }, Error::Code::invalid_argument, {"unknown backend 'gpu'", "reference"});
  unsetenv("MXQ_BACKEND");
}

TEST(Api, EmptyTensorsAreNoOps) {
  QuantOptions o = QuantOptions::mx(Format::mxfp4, ScaleRule::floor);
  Tensor x = Tensor::of(static_cast<float*>(nullptr), DType::f32, 0, 64);
  QuantizedOut out;
  out.codes = Tensor::of(static_cast<std::uint8_t*>(nullptr), DType::u8, 0, 32);
  out.scales = Tensor::of(static_cast<std::uint8_t*>(nullptr), DType::u8, 0, 2);
  EXPECT_NO_THROW(quantize(x, out, o));
  EXPECT_NO_THROW(qdq(x, x, o));
}

TEST(Api, ShapeHelpersAndNames) {
  QuantOptions o = QuantOptions::mx(Format::mxfp4, ScaleRule::floor);
  EXPECT_EQ(code_cols(Format::mxfp4, 33), 17);
  EXPECT_EQ(code_cols(Format::mxfp6_e2m3, 33), 33);
  EXPECT_EQ(scale_shape(o, 3, 33), (Shape2{3, 2}));
  o.scale_layout = ScaleLayout::swizzled;
  EXPECT_EQ(scale_shape(o, 130, 33), (Shape2{256, 4}));
  EXPECT_EQ(scale_shape(QuantOptions::nvfp4(), 2, 64), (Shape2{2, 4}));
  EXPECT_EQ(clip_mask_shape(2, 9), (Shape2{2, 2}));
  EXPECT_EQ(parse_format("mxfp8_e4m3"), Format::mxfp8_e4m3);
  EXPECT_EQ(parse_rule("rceil"), ScaleRule::rceil);
  EXPECT_EQ(parse_rule("even_fp4"), ScaleRule::even_fp4);
  expect_error([] { parse_format("fp4"); }, Error::Code::invalid_argument, {"unknown format 'fp4'", "mxfp4", "nvfp4"});
  EXPECT_EQ(format_info(Format::mxfp8_e5m2).max_elem, 57344.0f);
  EXPECT_EQ(format_info(Format::mxint8).max_elem, 127.0f / 64.0f);
  EXPECT_EQ(nvfp4_tensor_scale_from_amax(2688.0f), 1.0f);
}

TEST(Api, PresetsMatchTheirDocumentedRules) {
  EXPECT_EQ(presets::vllm_mxfp4_qdq().rule, ScaleRule::even);
  EXPECT_EQ(presets::vllm_mxfp4_qdq().format, Format::mxfp4);
  EXPECT_EQ(presets::vllm_mxfp8_qdq().rule, ScaleRule::floor);
  EXPECT_EQ(presets::vllm_mxfp8_qdq().format, Format::mxfp8_e4m3);
  EXPECT_EQ(presets::ocp_mx(Format::mxint8).rule, ScaleRule::floor);
  EXPECT_EQ(presets::mxfp8_rceil().rule, ScaleRule::rceil);
  EXPECT_EQ(presets::qutlass_mx_quest().scale_layout, ScaleLayout::swizzled);
  EXPECT_EQ(presets::qutlass_mx_absmax().rule, ScaleRule::qutlass_absmax);
  EXPECT_EQ(*presets::qutlass_nv(3.0f).tensor_scale, 3.0f);
  EXPECT_EQ(presets::torchao_mx(Format::mxfp8_e5m2, ScaleRule::ceil).rule, ScaleRule::ceil);
  expect_error([] { presets::torchao_mx(Format::mxfp4, ScaleRule::quest); }, Error::Code::invalid_argument, {"'rule'", "quest"});
  EXPECT_EQ(presets::compressed_tensors_mx(Format::mxfp8_e4m3).rule, ScaleRule::even_fp4);
  EXPECT_EQ(presets::compressed_tensors_mx(Format::mxfp4).format, Format::mxfp4);
  expect_error([] { presets::compressed_tensors_mx(Format::mxfp6_e2m3); }, Error::Code::invalid_argument,
               {"'format'", "mxfp6_e2m3"});
  // The vLLM MXFP4 preset's scale bump: a block with amax 7 gets e = 1 (floor would give 0).
  HostTensor x(DType::bf16, 1, 32);
  for (int k = 0; k < 32; ++k) x.set(0, k, k == 0 ? 7.0f : 0.5f);
  const QuantOptions o = presets::vllm_mxfp4_qdq();
  Quantized q(o, 1, 32);
  quantize(x.view(), q.out(), o);
  EXPECT_EQ(q.scale(0, 0), 128);
  // QuTLASS abs_max: dequantized values are 3x the input scale (its GEMM multiplies by 1/9).
  HostTensor y(DType::bf16, 1, 32);
  HostTensor ones(DType::bf16, 1, 32);
  for (int k = 0; k < 32; ++k) ones.set(0, k, 1.0f);
  qdq(ones.view(), y.view(), presets::qutlass_mx_absmax());
  EXPECT_EQ(y.get(0, 0), 3.0f);
}

// A caller running with flush-to-zero / denormals-are-zero (MXCSR FTZ and DAZ on the calling thread and
// on every OpenMP worker, as torch.set_flush_denormal(True) leaves a thread) gets the bytes of IEEE
// subnormals from the CPU backends, and its own setting back after each call (mxq/fp_env.hpp).
TEST(Api, FlushToZeroCallersGetIeeeBytes) {
#if !(defined(__x86_64__) || defined(__i386__))
  GTEST_SKIP() << "the test sets x86's MXCSR";
#else
  constexpr unsigned kFtzDaz = 0x8040;
  const auto set_everywhere = [](bool on) {
    const auto apply = [on] { _mm_setcsr(on ? (_mm_getcsr() | kFtzDaz) : (_mm_getcsr() & ~kFtzDaz)); };
    apply();
#if defined(_OPENMP)
#pragma omp parallel
    apply();
#endif
  };
  // bf16 subnormals and small normals (|x| from 2^-140 to 2^-120), signs mixed, every block different
  HostTensor x(DType::bf16, 64, 256);
  for (std::int64_t r = 0; r < 64; ++r)
    for (std::int64_t c = 0; c < 256; ++c) {
      const unsigned h = unsigned(r * 256 + c) * 2654435761u;
      x.set(r, c, std::ldexp(float(h % 997) * ((h >> 12) & 1 ? -1.0f : 1.0f), -150 + int(h % 20)));
    }
  struct Run {
    std::vector<std::uint8_t> codes, scales, y;
  };
  const auto run = [&](Backend b, const QuantOptions& base) {
    QuantOptions o = base;
    o.backend = b;
    Quantized q(o, 64, 256);
    quantize(x.view(), q.out(), o);
    HostTensor y(DType::bf16, 64, 256);
    qdq(x.view(), y.view(), o);
    return Run{q.codes.bytes, q.scales.bytes, y.bytes};
  };
  for (const QuantOptions& o : {QuantOptions::mx(Format::mxfp4, ScaleRule::even), QuantOptions::mx(Format::mxfp8_e4m3, ScaleRule::floor),
                                QuantOptions::nvfp4(1e30f)})
    for (Backend b : {Backend::reference, Backend::cpu}) {
      const Run ieee = run(b, o);
      set_everywhere(true);
      const Run ftz = run(b, o);
      const bool kept = (_mm_getcsr() & kFtzDaz) == kFtzDaz;
      set_everywhere(false);
      EXPECT_TRUE(kept) << "the caller's FTZ / DAZ were not restored";
      const std::string what = std::string(to_string(o.format)) + " on " + std::string(to_string(b));
      EXPECT_EQ(ftz.codes, ieee.codes) << what;
      EXPECT_EQ(ftz.scales, ieee.scales) << what;
      EXPECT_EQ(ftz.y, ieee.y) << what;
    }
#endif
}
