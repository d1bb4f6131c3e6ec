// W4A16 mixture of experts (include/mxq/moe.hpp, docs/moe.md): the entry points that validate once and
// dispatch, and the reference (the definition in docs/numerics.md, "W4A16 MoE"), whose expert GEMMs are
// the dense linear's reference (cpu/reference/linear_reference.hpp) on gathered rows.
#include <mxq/moe.hpp>

#include <array>
#include <cmath>
#include <cstdint>
#include <string>
#include <vector>

#include "core/moe_math.hpp"
#include "core/validate.hpp"
#include "cpu/reference/linear_reference.hpp"
#include "entry.hpp"

#if defined(MXQ_HAVE_CUDA)
#include "cuda/backend.hpp"
#endif

namespace mxq {

namespace {

using core::Checker;
using i64 = std::int64_t;

constexpr i64 kMaxIndex = (i64(1) << 31) - 1;  // pair, position and expert indices are i32

int block_of(Format f) { return format_info(f).default_group; }

// The argument names of one PackedExperts (string literals: Checker keeps the pointers).
struct ExpertNames {
  const char *self, *codes, *scales, *exp_shift, *tensor_scale;
};
constexpr ExpertNames kW{"w", "w.codes", "w.scales", "w.exp_shift", "w.tensor_scale"};
constexpr ExpertNames kW13{"w13", "w13.codes", "w13.scales", "w13.exp_shift", "w13.tensor_scale"};
constexpr ExpertNames kW2{"w2", "w2.codes", "w2.scales", "w2.exp_shift", "w2.tensor_scale"};

void check_experts(Checker& c, const ExpertNames& nm, const PackedExperts& w, Device dev) {
  const std::string self(nm.self);
  if (w.format != Format::mxfp4 && w.format != Format::nvfp4)
    c.unsupported(self + ".format '" + std::string(to_string(w.format)) + "': the W4A16 MoE takes mxfp4 or nvfp4 experts");
  const int g = block_of(w.format);
  if (w.E < 1 || w.E > kMaxIndex)
    c.fail(self + ".E " + std::to_string(w.E) + ": expected 1 <= E < 2^31 experts");
  if (w.N < 1 || w.K < 1 || w.K % g != 0 || w.N > kMaxIndex || w.K > kMaxIndex)
    c.fail(self + " expert shape " + core::shape_str(w.N, w.K) + ": expected N >= 1 and K a positive multiple of " +
           std::to_string(g) + " (the " + std::string(to_string(w.format)) + " block), both below 2^31");
  const Shape2 b = packed_expert_bytes(w.format, w.N, w.K);
  c.view(nm.codes, w.codes, DType::u8, w.E, b.rows, true);
  c.view(nm.scales, w.scales, DType::u8, w.E, b.cols, true);
  c.view(nm.exp_shift, w.exp_shift, DType::i32, 1, w.E, true);
  c.view(nm.tensor_scale, w.tensor_scale, DType::f32, 1, w.E, true);
  c.same_device(nm.codes, w.codes, dev);
  c.same_device(nm.scales, w.scales, dev);
  c.same_device(nm.exp_shift, w.exp_shift, dev);
  c.same_device(nm.tensor_scale, w.tensor_scale, dev);
  if (dev != Device::cpu) return;  // the per-expert facts live on the device; prepack_experts set them
  const auto* d = static_cast<const std::int32_t*>(w.exp_shift.data);
  const auto* s = static_cast<const float*>(w.tensor_scale.data);
  for (i64 e = 0; e < w.E; ++e) {
    if (w.format == Format::nvfp4 && !(std::isfinite(s[e]) && s[e] > 0))
      c.fail(self + ".tensor_scale of expert " + std::to_string(e) + ": " + std::to_string(s[e]) +
             ", expected the NVFP4 encode scale S, finite and > 0");
    if (w.format == Format::mxfp4 && s[e] != 1.0f)
      c.fail(self + ".tensor_scale of expert " + std::to_string(e) + ": " + std::to_string(s[e]) + ", expected 1 for mxfp4");
    if (w.format == Format::nvfp4 && d[e] != 8)
      c.fail(self + ".exp_shift of expert " + std::to_string(e) + ": " + std::to_string(d[e]) + ", prepack sets 8 for nvfp4");
    if (w.format == Format::mxfp4 && (d[e] < -128 || d[e] > 127))
      c.fail(self + ".exp_shift of expert " + std::to_string(e) + ": " + std::to_string(d[e]) +
             ", prepack sets max E8M0 - 128, in [-128, 127]");
  }
}

void record_experts(Checker& c, const ExpertNames& nm, const PackedExperts& w) {
  c.record(nm.codes, w.codes, false);
  c.record(nm.scales, w.scales, false);
  c.record(nm.exp_shift, w.exp_shift, false);
  c.record(nm.tensor_scale, w.tensor_scale, false);
}

void check_activation_args(const Checker& c, MoeActivation kind, float alpha, float limit) {
  if (kind != MoeActivation::none && kind != MoeActivation::swiglu && kind != MoeActivation::swiglu_oai)
    c.fail("activation: invalid value " + std::to_string(int(kind)));
  if (kind == MoeActivation::swiglu_oai && !(std::isfinite(alpha) && std::isfinite(limit) && limit >= 0))
    c.fail("swiglu_oai: alpha " + std::to_string(alpha) + ", limit " + std::to_string(limit) +
           ": expected finite values, limit >= 0 (gpt-oss: 1.702, 7.0)");
}

void check_float_dtype(const Checker& c, const char* arg, const Tensor& t, bool f32_too) {
  if (t.dtype != DType::bf16 && t.dtype != DType::f16 && !(f32_too && t.dtype == DType::f32))
    c.fail(std::string("argument '") + arg + "': dtype " + std::string(to_string(t.dtype)) + ", expected " +
           (f32_too ? "f32, bf16 or f16" : "bf16 or f16"));
}

// The CUDA kernels read x (and the activations) in 16-byte vectors.
void check_x_aligned(const Checker& c, const char* arg, const Tensor& x) {
  if (reinterpret_cast<std::uintptr_t>(x.data) % 16 != 0 || (x.stride() * 2) % 16 != 0)
    c.unsupported(std::string(arg) + ": the CUDA kernels read it in 16-byte vectors; its data pointer and row stride (" +
                  std::to_string(x.stride()) + " elements) must be 16-byte aligned");
}

// ---- host helpers -----------------------------------------------------------------------------------
float ld(const Tensor& t, i64 r, i64 col) { return core::load_f32(t, r, col); }
i64 id_at(const Tensor& ids, i64 t, i64 j) {
  const i64 i = t * ids.stride() + j;
  return ids.dtype == DType::i32 ? i64(static_cast<const std::int32_t*>(ids.data)[i])
                                 : static_cast<const std::int64_t*>(ids.data)[i];
}
void st(const Tensor& t, i64 r, i64 col, float v) { core::store_bits(t, r, col, core::round_to_dtype_bits(v, t.dtype)); }
std::int32_t* i32p(const Tensor& t) { return static_cast<std::int32_t*>(t.data); }

// Expert e of w as a PackedWeight (host memory; no checks).
PackedWeight expert_view(const PackedExperts& w, i64 e) {
  const PackedLayout L = packed_layout(w.format, w.N, w.K);
  PackedWeight p;
  p.format = w.format;
  p.N = w.N;
  p.K = w.K;
  p.codes = Tensor::of(static_cast<std::uint8_t*>(w.codes.data) + e * w.codes.stride(), DType::u8, L.codes.rows, L.codes.cols,
                       0, w.codes.device);
  p.scales = Tensor::of(static_cast<std::uint8_t*>(w.scales.data) + e * w.scales.stride(), DType::u8, L.scales.rows,
                        L.scales.cols, 0, w.scales.device);
  p.exp_shift = static_cast<const std::int32_t*>(w.exp_shift.data)[e];
  p.tensor_scale = static_cast<const float*>(w.tensor_scale.data)[e];
  p.f16_exact = w.f16_exact;
  return p;
}

// ---- the reference ----------------------------------------------------------------------------------
// Every id in [0, E): else Error(invalid_argument) naming the token and slot.
void ref_check_ids(const Checker& c, const Tensor& ids, i64 E) {
  for (i64 t = 0; t < ids.rows; ++t)
    for (i64 j = 0; j < ids.cols; ++j)
      if (const i64 e = id_at(ids, t, j); e < 0 || e >= E)
        c.fail("topk_ids: token " + std::to_string(t) + ", slot " + std::to_string(j) + " routes to expert " +
               std::to_string(e) + ", expected an id in [0, " + std::to_string(E) + ")");
}

void ref_route(const Tensor& ids, i64 E, const Tensor& offsets, const Tensor& sorted, const Tensor& pos, const Tensor& flag) {
  const i64 k = ids.cols, P = ids.rows * k;
  std::int32_t* off = i32p(offsets);
  for (i64 e = 0; e <= E; ++e) off[e] = 0;
  for (i64 p = 0; p < P; ++p) ++off[id_at(ids, p / k, p % k) + 1];
  for (i64 e = 0; e < E; ++e) off[e + 1] += off[e];
  std::vector<std::int32_t> next(off, off + E);
  for (i64 p = 0; p < P; ++p) {  // ascending pair index within each expert
    const std::int32_t q = next[static_cast<std::size_t>(id_at(ids, p / k, p % k))]++;
    i32p(sorted)[q] = std::int32_t(p);
    i32p(pos)[p] = q;
  }
  i32p(flag)[0] = 0;
}

// offsets / sorted_pairs as moe_route writes them (host data): checked before the reference reads by them.
void ref_check_routing(const Checker& c, i64 E, i64 P, const Tensor& offsets, const Tensor& sorted) {
  const std::int32_t* off = i32p(offsets);
  if (off[0] != 0 || off[E] > P)
    c.fail("expert_offsets: [0] = " + std::to_string(off[0]) + ", [E] = " + std::to_string(off[E]) +
           ", expected 0 and at most P = " + std::to_string(P) + " (moe_route's output)");
  for (i64 e = 0; e < E; ++e)
    if (off[e + 1] < off[e])
      c.fail("expert_offsets: decreasing at expert " + std::to_string(e) + " (moe_route's output is non-decreasing)");
  for (i64 q = 0; q < off[E]; ++q)
    if (const std::int32_t p = i32p(sorted)[q]; p < 0 || p >= P)
      c.fail("sorted_pairs[" + std::to_string(q) + "] = " + std::to_string(p) + ", expected a pair index in [0, " +
             std::to_string(P) + ")");
}

void ref_linear(const Tensor& x, MoeRows rows, i64 k, const PackedExperts& w, const Tensor* bias, const Tensor& offsets,
                const Tensor& sorted, const Tensor* row_scale, const Tensor& y) {
  const std::int32_t* off = i32p(offsets);
  const i64 P = y.rows;
  std::vector<i64> src;
  std::vector<float> acc;
  for (i64 e = 0; e < w.E; ++e) {
    const i64 q0 = off[e], n = off[e + 1] - off[e];
    if (n == 0) continue;  // an expert without pairs costs nothing
    src.resize(static_cast<std::size_t>(n));
    for (i64 i = 0; i < n; ++i) src[i] = rows == MoeRows::token ? i32p(sorted)[q0 + i] / k : q0 + i;
    acc.resize(static_cast<std::size_t>(n * w.N));
    Tensor be;
    if (bias) be = Tensor::of(static_cast<std::uint8_t*>(bias->data) + e * bias->stride() * 2, bias->dtype, 1, w.N);
    ref::linear_f32(x, src.data(), n, expert_view(w, e), bias ? &be : nullptr, acc.data());
    for (i64 i = 0; i < n; ++i) {
      const i64 p = i32p(sorted)[q0 + i];
      const float s = row_scale ? ld(*row_scale, p / k, p % k) : 1.0f;
      for (i64 col = 0; col < w.N; ++col) {
        const float v = acc[static_cast<std::size_t>(i * w.N + col)];
        st(y, q0 + i, col, row_scale ? core::mul_rn(v, s) : v);
      }
    }
  }
  for (i64 q = off[w.E]; q < P; ++q)  // dropped pairs' rows: zeros, never uninitialised memory
    for (i64 col = 0; col < w.N; ++col) st(y, q, col, 0.0f);
}

void ref_activation(const Tensor& h, MoeActivation kind, float alpha, float limit, const Tensor& a) {
  const i64 I = a.cols;
  for (i64 r = 0; r < h.rows; ++r)
    for (i64 i = 0; i < I; ++i) {
      float v;
      switch (kind) {
        case MoeActivation::none: v = ld(h, r, i); break;
        case MoeActivation::swiglu: v = core::moe_swiglu(ld(h, r, i), ld(h, r, I + i)); break;
        default: v = core::moe_swiglu_oai(ld(h, r, 2 * i), ld(h, r, 2 * i + 1), alpha, limit); break;
      }
      st(a, r, i, v);
    }
}

void ref_combine(const Tensor& o, const Tensor& pos, i64 k, const Tensor& y) {
  for (i64 t = 0; t < y.rows; ++t)
    for (i64 col = 0; col < y.cols; ++col) {
      float s = 0.0f;
      bool first = true;
      for (i64 j = 0; j < k; ++j) {
        const std::int32_t q = i32p(pos)[t * k + j];
        if (q < 0) continue;  // a dropped pair (device routing with an id out of range)
        const float v = ld(o, q, col);
        s = first ? v : core::add_rn(s, v);
        first = false;
      }
      st(y, t, col, s);
    }
}

}  // namespace

// ---- names ------------------------------------------------------------------------------------------------
std::string_view to_string(MoeActivation a) {
  switch (a) {
    case MoeActivation::none: return "none";
    case MoeActivation::swiglu: return "swiglu";
    case MoeActivation::swiglu_oai: return "swiglu_oai";
  }
  return "?";
}

MoeActivation parse_moe_activation(std::string_view s) {
  for (MoeActivation a : {MoeActivation::none, MoeActivation::swiglu, MoeActivation::swiglu_oai})
    if (s == to_string(a)) return a;
  throw Error(Error::Code::invalid_argument,
              "mxq: unknown MoE activation '" + std::string(s) + "'; valid: none, swiglu, swiglu_oai");
}

// ---- packing ------------------------------------------------------------------------------------------------
Shape2 packed_expert_bytes(Format format, i64 N, i64 K) {
  const PackedLayout L = packed_layout(format, N, K);
  return {L.codes.rows * L.codes.cols, L.scales.rows * L.scales.cols};
}

void prepack_experts(const QuantizedIn* q, const QuantOptions& opt, const float* tensor_scales, PackedExperts& out) {
  Checker c("prepack_experts");
  if (!q) c.fail("q: null; expected E quantized weights");
  if (out.format != opt.format)
    c.fail("out.format '" + std::string(to_string(out.format)) + "' differs from opt.format '" + std::string(to_string(opt.format)) + "'");
  if (out.format != Format::mxfp4 && out.format != Format::nvfp4)
    c.unsupported("out.format '" + std::string(to_string(out.format)) + "': the W4A16 MoE takes mxfp4 or nvfp4 experts");
  if (out.E < 1 || out.E > kMaxIndex) c.fail("out.E " + std::to_string(out.E) + ": expected 1 <= E < 2^31 experts");
  const Shape2 bytes = packed_expert_bytes(out.format, out.N, out.K);  // checks N and K
  c.view("out.codes", out.codes, DType::u8, out.E, bytes.rows, true);
  c.view("out.scales", out.scales, DType::u8, out.E, bytes.cols, true);
  c.view("out.exp_shift", out.exp_shift, DType::i32, 1, out.E, true);
  c.view("out.tensor_scale", out.tensor_scale, DType::f32, 1, out.E, true);
  for (auto [arg, t] : {std::pair{"out.codes", &out.codes}, {"out.scales", &out.scales}, {"out.exp_shift", &out.exp_shift},
                        {"out.tensor_scale", &out.tensor_scale}})
    c.same_device(arg, *t, Device::cpu);
  if (opt.format == Format::nvfp4 && !tensor_scales) c.fail("tensor_scales: null; nvfp4 experts need their encode scales S");
  bool f16_exact = true;
  for (i64 e = 0; e < out.E; ++e) {
    const float S = opt.format == Format::nvfp4 ? tensor_scales[e] : 1.0f;
    if (!(std::isfinite(S) && S > 0))
      c.fail("tensor_scales[" + std::to_string(e) + "] = " + std::to_string(S) + ": expected a finite encode scale > 0");
    PackedWeight w;
    w.format = out.format;
    w.N = out.N;
    w.K = out.K;
    const PackedLayout L = packed_layout(w.format, w.N, w.K);
    w.codes = Tensor::of(static_cast<std::uint8_t*>(out.codes.data) + e * out.codes.stride(), DType::u8, L.codes.rows, L.codes.cols);
    w.scales = Tensor::of(static_cast<std::uint8_t*>(out.scales.data) + e * out.scales.stride(), DType::u8, L.scales.rows, L.scales.cols);
    prepack(q[e], opt, w);  // validates q[e] and names it "q.codes" / "q.scales"
    i32p(out.exp_shift)[e] = w.exp_shift;
    static_cast<float*>(out.tensor_scale.data)[e] = S;
    f16_exact = f16_exact && w.f16_exact;
  }
  out.f16_exact = f16_exact;
}

PackedWeight expert(const PackedExperts& w, i64 e) {
  Checker c("expert");
  check_experts(c, kW, w, Device::cpu);
  if (e < 0 || e >= w.E) c.fail("e " + std::to_string(e) + ": expected an expert index in [0, " + std::to_string(w.E) + ")");
  PackedWeight p = expert_view(w, e);
  return p;
}

// ---- the primitives ------------------------------------------------------------------------------------------------
void moe_route(const Tensor& topk_ids, i64 E, const Tensor& expert_offsets, const Tensor& sorted_pairs, const Tensor& pair_pos,
               const Tensor& error_flag, Backend backend, void* stream) {
  Checker c("moe_route");
  if (topk_ids.dtype != DType::i32 && topk_ids.dtype != DType::i64)
    c.fail("argument 'topk_ids': dtype " + std::string(to_string(topk_ids.dtype)) + ", expected i32 or i64");
  c.view("topk_ids", topk_ids, topk_ids.dtype, topk_ids.rows, topk_ids.cols);
  const i64 k = topk_ids.cols, P = topk_ids.rows * k;
  if (k < 1) c.fail("topk_ids: shape " + core::shape_str(topk_ids.rows, k) + ", expected [T, k] with k >= 1");
  if (P > kMaxIndex) c.unsupported("topk_ids: " + std::to_string(P) + " pairs (T * k), expected below 2^31");
  if (E < 1 || E >= kMaxIndex) c.fail("E " + std::to_string(E) + ": expected 1 <= E < 2^31 - 1 experts");
  c.view("expert_offsets", expert_offsets, DType::i32, 1, E + 1, true);
  c.view("sorted_pairs", sorted_pairs, DType::i32, 1, P, true);
  c.view("pair_pos", pair_pos, DType::i32, 1, P, true);
  c.view("error_flag", error_flag, DType::i32, 1, 1, true);
  for (auto [arg, t] : {std::pair{"expert_offsets", &expert_offsets}, {"sorted_pairs", &sorted_pairs}, {"pair_pos", &pair_pos},
                        {"error_flag", &error_flag}})
    c.same_device(arg, *t, topk_ids.device);
  c.record("topk_ids", topk_ids, false);
  c.record("expert_offsets", expert_offsets, true);
  c.record("sorted_pairs", sorted_pairs, true);
  c.record("pair_pos", pair_pos, true);
  c.record("error_flag", error_flag, true);
  c.no_overlap();
  const Backend b = detail::choose("moe_route", nullptr, topk_ids,
                                   {{"topk_ids", topk_ids.data}, {"expert_offsets", expert_offsets.data},
                                    {"sorted_pairs", sorted_pairs.data}, {"pair_pos", pair_pos.data}, {"error_flag", error_flag.data}},
                                   backend, true);
#if defined(MXQ_HAVE_CUDA)
  if (b == Backend::cuda) return cuda::moe_route(topk_ids, E, expert_offsets, sorted_pairs, pair_pos, error_flag, stream);
#endif
  (void)b;
  (void)stream;
  ref_check_ids(c, topk_ids, E);
  ref_route(topk_ids, E, expert_offsets, sorted_pairs, pair_pos, error_flag);
}

void moe_linear(const Tensor& x, MoeRows rows, i64 k, const PackedExperts& w, const Tensor* bias, const Tensor& expert_offsets,
                const Tensor& sorted_pairs, const Tensor* row_scale, const Tensor& y, Backend backend, void* stream) {
  Checker c("moe_linear");
  check_float_dtype(c, "x", x, false);
  check_experts(c, kW, w, x.device);
  if (rows != MoeRows::token && rows != MoeRows::sorted) c.fail("rows: invalid value " + std::to_string(int(rows)));
  if (k < 1) c.fail("k " + std::to_string(k) + ": expected the routing's top-k, >= 1");
  const i64 P = sorted_pairs.cols;
  c.view("sorted_pairs", sorted_pairs, DType::i32, 1, P, true);
  if (P % k != 0) c.fail("sorted_pairs: " + std::to_string(P) + " pairs, expected a multiple of k = " + std::to_string(k));
  const i64 T = P / k;
  if (x.cols != w.K)
    c.fail("x: shape " + core::shape_str(x.rows, x.cols) + ", expected K = " + std::to_string(w.K) + " columns (the experts' K)");
  c.view("x", x, x.dtype, rows == MoeRows::token ? T : P, w.K);
  c.view("expert_offsets", expert_offsets, DType::i32, 1, w.E + 1, true);
  if (bias) {
    c.view("bias", *bias, x.dtype, w.E, w.N, true);
    c.same_device("bias", *bias, x.device);
  }
  if (row_scale) {
    check_float_dtype(c, "row_scale", *row_scale, true);
    c.view("row_scale", *row_scale, row_scale->dtype, T, k);
    c.same_device("row_scale", *row_scale, x.device);
  }
  c.view("y", y, row_scale ? DType::f32 : x.dtype, P, w.N, true);
  c.same_device("expert_offsets", expert_offsets, x.device);
  c.same_device("sorted_pairs", sorted_pairs, x.device);
  c.same_device("y", y, x.device);
  if (x.dtype == DType::f16 && !w.f16_exact)
    c.unsupported("x: f16 activations with mxfp4 experts whose block scales span more than 2^24; use bf16 activations");
  c.record("x", x, false);
  record_experts(c, kW, w);
  if (bias) c.record("bias", *bias, false);
  if (row_scale) c.record("row_scale", *row_scale, false);
  c.record("expert_offsets", expert_offsets, false);
  c.record("sorted_pairs", sorted_pairs, false);
  c.record("y", y, true);
  c.no_overlap();
  const Backend b = detail::choose("moe_linear", nullptr, x,
                                   {{"x", x.data}, {"w.codes", w.codes.data}, {"w.scales", w.scales.data},
                                    {"w.exp_shift", w.exp_shift.data}, {"w.tensor_scale", w.tensor_scale.data},
                                    {"bias", bias ? bias->data : nullptr}, {"row_scale", row_scale ? row_scale->data : nullptr},
                                    {"expert_offsets", expert_offsets.data}, {"sorted_pairs", sorted_pairs.data}, {"y", y.data}},
                                   backend, true);
#if defined(MXQ_HAVE_CUDA)
  if (b == Backend::cuda) {
    check_x_aligned(c, "x", x);
    return cuda::moe_linear(x, rows == MoeRows::token, k, w, bias, expert_offsets, sorted_pairs, row_scale, y, stream);
  }
#endif
  (void)b;
  (void)stream;
  ref_check_routing(c, w.E, P, expert_offsets, sorted_pairs);
  ref_linear(x, rows, k, w, bias, expert_offsets, sorted_pairs, row_scale, y);
}

void moe_activation(const Tensor& h, MoeActivation kind, float alpha, float limit, const Tensor& a, Backend backend, void* stream) {
  Checker c("moe_activation");
  check_float_dtype(c, "h", h, false);
  check_activation_args(c, kind, alpha, limit);
  const i64 I = a.cols;
  c.view("a", a, h.dtype, h.rows, I, true);
  if (I < 1) c.fail("a: shape " + core::shape_str(a.rows, I) + ", expected I >= 1 columns");
  c.view("h", h, h.dtype, a.rows, kind == MoeActivation::none ? I : 2 * I, true);
  c.same_device("a", a, h.device);
  c.record("h", h, false);
  c.record("a", a, true);
  c.no_overlap();
  const Backend b = detail::choose("moe_activation", nullptr, h, {{"h", h.data}, {"a", a.data}}, backend, true);
#if defined(MXQ_HAVE_CUDA)
  if (b == Backend::cuda) return cuda::moe_activation(h, kind, alpha, limit, a, stream);
#endif
  (void)b;
  (void)stream;
  ref_activation(h, kind, alpha, limit, a);
}

void moe_combine(const Tensor& o, const Tensor& pair_pos, i64 k, const Tensor& y, Backend backend, void* stream) {
  Checker c("moe_combine");
  check_float_dtype(c, "y", y, false);
  if (k < 1) c.fail("k " + std::to_string(k) + ": expected the routing's top-k, >= 1");
  const i64 T = y.rows, H = y.cols, P = T * k;
  c.view("y", y, y.dtype, T, H);
  c.view("o", o, DType::f32, P, H, true);
  c.view("pair_pos", pair_pos, DType::i32, 1, P, true);
  c.same_device("o", o, y.device);
  c.same_device("pair_pos", pair_pos, y.device);
  c.record("o", o, false);
  c.record("pair_pos", pair_pos, false);
  c.record("y", y, true);
  c.no_overlap();
  const Backend b = detail::choose("moe_combine", nullptr, y, {{"o", o.data}, {"pair_pos", pair_pos.data}, {"y", y.data}}, backend, true);
#if defined(MXQ_HAVE_CUDA)
  if (b == Backend::cuda) return cuda::moe_combine(o, pair_pos, k, y, stream);
#endif
  (void)b;
  (void)stream;
  for (i64 p = 0; p < P; ++p)
    if (const std::int32_t q = i32p(pair_pos)[p]; q < -1 || q >= P)
      c.fail("pair_pos[" + std::to_string(p) + "] = " + std::to_string(q) + ", expected -1 or a position in [0, " +
             std::to_string(P) + ")");
  ref_combine(o, pair_pos, k, y);
}

// ---- the whole block ------------------------------------------------------------------------------------------------
MoeWorkspace moe_workspace(i64 T, i64 k, i64 E, i64 N13, i64 I, i64 H, MoeActivation activation) {
  Checker c("moe_workspace");
  check_activation_args(c, activation, 0.0f, 0.0f);
  if (T < 0 || k < 1 || E < 1 || N13 < 1 || I < 1 || H < 1)
    c.fail("T " + std::to_string(T) + ", k " + std::to_string(k) + ", E " + std::to_string(E) + ", N13 " + std::to_string(N13) +
           ", I " + std::to_string(I) + ", H " + std::to_string(H) + ": expected T >= 0 and the others >= 1");
  const i64 P = T * k;
  if (P > kMaxIndex || E >= kMaxIndex) c.unsupported("T * k and E below 2^31");
  auto up = [](i64 bytes) { return (bytes + 255) / 256 * 256; };
  MoeWorkspace ws;
  i64 at = 0;
  ws.expert_offsets = at;
  at += up(4 * (E + 1));
  ws.sorted_pairs = at;
  at += up(4 * P);
  ws.pair_pos = at;
  at += up(4 * P);
  ws.error_flag = at;
  at += up(4);
  ws.h = at;
  at += up(2 * P * N13);
  ws.a = activation == MoeActivation::none ? ws.h : at;
  if (activation != MoeActivation::none) at += up(2 * P * I);
  ws.o = at;
  at += up(4 * P * H);
  ws.bytes = at;
  return ws;
}

void moe(const Tensor& x, const PackedExperts& w13, const Tensor* b13, const PackedExperts& w2, const Tensor* b2,
         const Tensor& topk_ids, const Tensor& topk_weights, MoeActivation activation, float alpha, float limit, const Tensor& y,
         const Tensor* workspace, Backend backend, void* stream) {
  Checker c("moe");
  check_float_dtype(c, "x", x, false);
  check_activation_args(c, activation, alpha, limit);
  check_experts(c, kW13, w13, x.device);
  check_experts(c, kW2, w2, x.device);
  if (w13.format != w2.format)
    c.fail("w13.format '" + std::string(to_string(w13.format)) + "' and w2.format '" + std::string(to_string(w2.format)) +
           "' differ; expected one format for both");
  if (w13.E != w2.E) c.fail("w13.E " + std::to_string(w13.E) + " and w2.E " + std::to_string(w2.E) + " differ");
  const i64 E = w13.E, H = x.cols, I = w2.K, g = block_of(w13.format);
  const i64 N13 = activation == MoeActivation::none ? I : 2 * I;
  if (H % g != 0 || I % g != 0)
    c.fail("H " + std::to_string(H) + ", I " + std::to_string(I) + ": expected multiples of " + std::to_string(g) + " (the " +
           std::string(to_string(w13.format)) + " block)");
  if (w13.K != H || w13.N != N13)
    c.fail("w13: experts [" + std::to_string(w13.N) + ", " + std::to_string(w13.K) + "], expected [" + std::to_string(N13) + ", " +
           std::to_string(H) + "] (" + (activation == MoeActivation::none ? "I" : "2I") + " = " + std::to_string(N13) +
           " with activation '" + std::string(to_string(activation)) + "', H = x's columns)");
  if (w2.N != H) c.fail("w2: experts [" + std::to_string(w2.N) + ", " + std::to_string(w2.K) + "], expected [H, I] with H = " + std::to_string(H));
  const i64 T = x.rows, k = topk_ids.cols;
  c.view("x", x, x.dtype, T, H);
  if (topk_ids.dtype != DType::i32 && topk_ids.dtype != DType::i64)
    c.fail("argument 'topk_ids': dtype " + std::string(to_string(topk_ids.dtype)) + ", expected i32 or i64");
  if (k < 1) c.fail("topk_ids: shape " + core::shape_str(topk_ids.rows, k) + ", expected [T, k] with k >= 1");
  c.view("topk_ids", topk_ids, topk_ids.dtype, T, k);
  check_float_dtype(c, "topk_weights", topk_weights, true);
  c.view("topk_weights", topk_weights, topk_weights.dtype, T, k);
  if (T * k > kMaxIndex) c.unsupported("topk_ids: " + std::to_string(T * k) + " pairs (T * k), expected below 2^31");
  if (b13) c.view("b13", *b13, x.dtype, E, N13, true);
  if (b2) c.view("b2", *b2, x.dtype, E, H, true);
  c.view("y", y, x.dtype, T, H);
  for (auto [arg, t] : {std::pair{"topk_ids", &topk_ids}, {"topk_weights", &topk_weights}, {"y", &y}}) c.same_device(arg, *t, x.device);
  if (b13) c.same_device("b13", *b13, x.device);
  if (b2) c.same_device("b2", *b2, x.device);
  if (x.dtype == DType::f16 && !(w13.f16_exact && w2.f16_exact))
    c.unsupported("x: f16 activations with mxfp4 experts whose block scales span more than 2^24; use bf16 activations");
  c.record("x", x, false);
  record_experts(c, kW13, w13);
  record_experts(c, kW2, w2);
  if (b13) c.record("b13", *b13, false);
  if (b2) c.record("b2", *b2, false);
  c.record("topk_ids", topk_ids, false);
  c.record("topk_weights", topk_weights, false);
  c.record("y", y, true);
  const Backend b = detail::choose("moe", nullptr, x,
                                   {{"x", x.data}, {"w13.codes", w13.codes.data}, {"w13.scales", w13.scales.data},
                                    {"w13.exp_shift", w13.exp_shift.data}, {"w13.tensor_scale", w13.tensor_scale.data},
                                    {"w2.codes", w2.codes.data}, {"w2.scales", w2.scales.data}, {"w2.exp_shift", w2.exp_shift.data},
                                    {"w2.tensor_scale", w2.tensor_scale.data}, {"b13", b13 ? b13->data : nullptr},
                                    {"b2", b2 ? b2->data : nullptr}, {"topk_ids", topk_ids.data}, {"topk_weights", topk_weights.data},
                                    {"y", y.data}, {"workspace", workspace ? workspace->data : nullptr}},
                                   backend, true);
  if (b == Backend::cuda) {
    const MoeWorkspace ws = moe_workspace(T, k, E, N13, I, H, activation);
    if (!workspace) c.fail("workspace: missing; the CUDA path needs " + std::to_string(ws.bytes) + " bytes of device memory (moe_workspace)");
    if (workspace->dtype != DType::u8 || workspace->rows != 1 || workspace->cols < ws.bytes)
      c.fail("argument 'workspace': " + std::string(to_string(workspace->dtype)) + " " + core::shape_str(workspace->rows, workspace->cols) +
             ", expected u8 [1, >= " + std::to_string(ws.bytes) + "] (moe_workspace)");
    c.same_device("workspace", *workspace, x.device);
    if (reinterpret_cast<std::uintptr_t>(workspace->data) % 256 != 0) c.fail("workspace: expected 256-byte aligned device memory");
    c.record("workspace", *workspace, true);
  }
  c.no_overlap();
#if defined(MXQ_HAVE_CUDA)
  if (b == Backend::cuda) {
    check_x_aligned(c, "x", x);
    return cuda::moe(x, w13, b13, w2, b2, topk_ids, topk_weights, activation, alpha, limit, y, *workspace, stream);
  }
#endif
  (void)stream;
  ref_check_ids(c, topk_ids, E);
  if (T == 0) return;

  // The reference: host buffers for the intermediate stages, the stages as the primitives compute them.
  const i64 P = T * k;
  std::vector<std::int32_t> off(static_cast<std::size_t>(E + 1)), sorted(static_cast<std::size_t>(P)),
      pos(static_cast<std::size_t>(P)), flag(1);
  const Tensor offv = Tensor::of(off.data(), DType::i32, 1, E + 1), sortedv = Tensor::of(sorted.data(), DType::i32, 1, P),
               posv = Tensor::of(pos.data(), DType::i32, 1, P), flagv = Tensor::of(flag.data(), DType::i32, 1, 1);
  ref_route(topk_ids, E, offv, sortedv, posv, flagv);
  std::vector<std::uint16_t> h(static_cast<std::size_t>(P * N13)), a;
  const Tensor hv = Tensor::of(h.data(), x.dtype, P, N13);
  ref_linear(x, MoeRows::token, k, w13, b13, offv, sortedv, nullptr, hv);
  Tensor av = hv;
  if (activation != MoeActivation::none) {
    a.resize(static_cast<std::size_t>(P * I));
    av = Tensor::of(a.data(), x.dtype, P, I);
    ref_activation(hv, activation, alpha, limit, av);
  }
  std::vector<float> o(static_cast<std::size_t>(P * H));
  const Tensor ov = Tensor::of(o.data(), DType::f32, P, H);
  ref_linear(av, MoeRows::sorted, k, w2, b2, offv, sortedv, &topk_weights, ov);
  ref_combine(ov, posv, k, y);
}

}  // namespace mxq
