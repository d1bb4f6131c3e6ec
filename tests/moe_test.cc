// The W4A16 MoE: the reference against an independent per-pair oracle (the dense reference linear per
// routed pair, the activation in double, the weighted fp32 sum over slots), exact on inputs whose fp32
// sums are exact; routing edge cases; argument errors; and the CUDA backend against the reference (exact
// but for the activation's documented tolerance), skipped where the backend cannot run.
#include <cmath>
#include <cstdint>
#include <cstring>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include <gtest/gtest.h>
#include <mxq/mxq.hpp>

#include "backends.hpp"
#include "helpers.hpp"

namespace {

using mxq::Backend;
using mxq::DType;
using mxq::Format;
using mxq::MoeActivation;
using th::HostTensor;

int block_of(Format f) { return f == Format::nvfp4 ? 16 : 32; }

mxq::QuantOptions opts(Format f) {
  return f == Format::nvfp4 ? mxq::QuantOptions::nvfp4(1.0f) : mxq::QuantOptions::mx(f, mxq::ScaleRule::floor);
}

// i32 views as HostTensor bytes.
HostTensor i32_tensor(std::int64_t rows, std::int64_t cols) { return HostTensor(DType::i32, rows, cols); }
std::int32_t geti(const HostTensor& t, std::int64_t i) {
  std::int32_t v;
  std::memcpy(&v, &t.bytes[i * 4], 4);
  return v;
}
void seti(HostTensor& t, std::int64_t i, std::int64_t v) {
  if (t.dtype == DType::i64) {
    std::memcpy(&t.bytes[i * 8], &v, 8);
  } else {
    const std::int32_t w = std::int32_t(v);
    std::memcpy(&t.bytes[i * 4], &w, 4);
  }
}

// E quantized experts [N, K] with random codes and scales from a small set (MXFP4 2^-1..2^1, NVFP4
// {0.5, 1, 1.5, 2, 3}): with x in {-2..2} every fp32 sum of the first GEMM is exact in any order.
struct Experts {
  Format f;
  std::int64_t E, N, K;
  std::vector<HostTensor> codes, scales;  // per expert: u8 [N, K/2], u8 [N, K/g]
  std::vector<float> S;
  HostTensor pc, ps, shift, ts;  // the packed form
  mxq::PackedExperts w;
};
std::unique_ptr<Experts> make_experts(Format f, std::int64_t E, std::int64_t N, std::int64_t K, std::uint32_t seed) {
  auto x = std::make_unique<Experts>();
  x->f = f;
  x->E = E;
  x->N = N;
  x->K = K;
  std::mt19937 rng(seed);
  static const std::uint8_t nv_exact[] = {0x30, 0x38, 0x3C, 0x40, 0x44};
  std::vector<mxq::QuantizedIn> q;
  for (std::int64_t e = 0; e < E; ++e) {
    x->codes.emplace_back(DType::u8, N, K / 2);
    x->scales.emplace_back(DType::u8, N, K / block_of(f));
    for (auto& b : x->codes.back().bytes) b = static_cast<std::uint8_t>(rng());
    for (auto& b : x->scales.back().bytes)
      b = f == Format::nvfp4 ? nv_exact[rng() % 5] : static_cast<std::uint8_t>(126 + rng() % 3);
    x->S.push_back(f == Format::nvfp4 ? float(1 << (e % 3)) : 1.0f);  // powers of two: / S stays exact
  }
  for (std::int64_t e = 0; e < E; ++e) q.push_back({x->codes[e].view(), x->scales[e].view()});
  const mxq::Shape2 b = mxq::packed_expert_bytes(f, N, K);
  x->pc = HostTensor(DType::u8, E, b.rows);
  x->ps = HostTensor(DType::u8, E, b.cols);
  x->shift = i32_tensor(1, E);
  x->ts = HostTensor(DType::f32, 1, E);
  x->w.format = f;
  x->w.E = E;
  x->w.N = N;
  x->w.K = K;
  x->w.codes = x->pc.view();
  x->w.scales = x->ps.view();
  x->w.exp_shift = x->shift.view();
  x->w.tensor_scale = x->ts.view();
  mxq::prepack_experts(q.data(), opts(f), x->S.data(), x->w);
  return x;
}

HostTensor make_x(DType dt, std::int64_t M, std::int64_t K, std::uint32_t seed) {
  HostTensor x(dt, M, K);
  std::mt19937 rng(seed);
  for (std::int64_t m = 0; m < M; ++m)
    for (std::int64_t k = 0; k < K; ++k) x.set(m, k, float(int(rng() % 5) - 2));
  return x;
}

// Routings: random (skewed towards low ids, so uneven), one expert taking every slot, or only two experts.
enum class Routing { uneven, one_expert, two_experts };
HostTensor make_ids(Routing r, std::int64_t T, std::int64_t k, std::int64_t E, std::uint32_t seed, DType dt = DType::i32) {
  HostTensor ids(dt, T, k);
  std::mt19937 rng(seed);
  for (std::int64_t t = 0; t < T; ++t)
    for (std::int64_t j = 0; j < k; ++j) {
      std::int64_t e = 0;
      if (r == Routing::uneven) e = std::min<std::int64_t>(E - 1, std::int64_t(rng() % E) * std::int64_t(rng() % E) / E + j % 2);
      if (r == Routing::one_expert) e = E / 2;
      if (r == Routing::two_experts) e = (t + j) % 2 ? 1 : E - 2;
      seti(ids, t * k + j, e);
    }
  return ids;
}
// Routing weights: small dyadic values (exact products), in f32, bf16 or f16.
HostTensor make_weights(DType dt, std::int64_t T, std::int64_t k, std::uint32_t seed) {
  HostTensor w(dt, T, k);
  std::mt19937 rng(seed);
  for (std::int64_t i = 0; i < T * k; ++i) w.set(i / k, i % k, float(1 + rng() % 8) / 8.0f);
  return w;
}
HostTensor make_bias(DType dt, std::int64_t E, std::int64_t N) {
  HostTensor b(dt, E, N);
  for (std::int64_t e = 0; e < E; ++e)
    for (std::int64_t n = 0; n < N; ++n) b.set(e, n, float((e * 3 + n) % 9) - 4.0f);
  return b;
}

std::int64_t id_of(const HostTensor& ids, std::int64_t p) {
  if (ids.dtype == DType::i64) {
    std::int64_t v;
    std::memcpy(&v, &ids.bytes[p * 8], 8);
    return v;
  }
  return geti(ids, p);
}

// The expert weight in fp32 through mxq::dequantize (independent of the packed layout).
HostTensor dequantized(const Experts& x, std::int64_t e) {
  HostTensor wf(DType::f32, x.N, x.K);
  mxq::QuantOptions o = opts(x.f);
  o.backend = Backend::reference;
  mxq::dequantize({x.codes[e].view(), x.scales[e].view()}, wf.view(), o);
  return wf;
}

// The activation in double with the C library's exp, rounded to fp32 and then to the dtype.
float activation_oracle(MoeActivation kind, float g, float u, float alpha, float limit) {
  if (kind == MoeActivation::swiglu) return float(double(g) / (1.0 + std::exp(-double(g))) * double(u));
  g = std::min(g, limit);
  u = std::max(-limit, std::min(u, limit));
  const double s = 1.0 / (1.0 + std::exp(-double(alpha) * double(g)));
  return float((double(u) + 1.0) * double(g) * s);
}

struct Case {
  Format f;
  DType dt;
  MoeActivation act;
  std::int64_t T, k, E, H, I;
  Routing routing;
  bool bias;
  DType wdt = DType::f32;   // topk_weights
  DType idt = DType::i32;   // topk_ids
  std::string name() const {
    return std::string(mxq::to_string(f)) + " " + std::string(mxq::to_string(dt)) + " " + std::string(mxq::to_string(act)) +
           " T" + std::to_string(T) + " k" + std::to_string(k) + " E" + std::to_string(E) + " routing" +
           std::to_string(int(routing)) + (bias ? " bias" : "");
  }
};

struct Problem {
  Case c;
  std::unique_ptr<Experts> w13, w2;
  HostTensor x, ids, tw, b13, b2;
  std::int64_t N13() const { return c.act == MoeActivation::none ? c.I : 2 * c.I; }
};
Problem make_problem(const Case& c, std::uint32_t seed) {
  Problem p{c, make_experts(c.f, c.E, c.act == MoeActivation::none ? c.I : 2 * c.I, c.H, seed),
            make_experts(c.f, c.E, c.H, c.I, seed + 1), make_x(c.dt, c.T, c.H, seed + 2),
            make_ids(c.routing, c.T, c.k, c.E, seed + 3, c.idt), make_weights(c.wdt, c.T, c.k, seed + 4), {}, {}};
  if (c.bias) {
    p.b13 = make_bias(c.dt, c.E, p.N13());
    p.b2 = make_bias(c.dt, c.E, c.H);
  }
  return p;
}

// y on backend b (the CUDA path with its workspace); a backend's error propagates (the test fails).
void run_moe(Backend b, const Problem& p, HostTensor& y) {
  const Case& c = p.c;
  y = HostTensor(c.dt, c.T, c.H);
  const mxq::MoeWorkspace ws = mxq::moe_workspace(c.T, c.k, c.E, p.N13(), c.I, c.H, c.act);
  th::Placed px(b, p.x), pids(b, p.ids), ptw(b, p.tw), py(b, y), pws(b, HostTensor(DType::u8, 1, ws.bytes));
  th::Placed c13(b, p.w13->pc), s13(b, p.w13->ps), d13(b, p.w13->shift), t13(b, p.w13->ts);
  th::Placed c2(b, p.w2->pc), s2(b, p.w2->ps), d2(b, p.w2->shift), t2(b, p.w2->ts);
  std::unique_ptr<th::Placed> pb13, pb2;
  mxq::Tensor b13v, b2v;
  if (c.bias) {
    pb13 = std::make_unique<th::Placed>(b, p.b13);
    pb2 = std::make_unique<th::Placed>(b, p.b2);
    b13v = pb13->view();
    b2v = pb2->view();
  }
  mxq::PackedExperts w13 = p.w13->w, w2 = p.w2->w;
  w13.codes = c13.view(), w13.scales = s13.view(), w13.exp_shift = d13.view(), w13.tensor_scale = t13.view();
  w2.codes = c2.view(), w2.scales = s2.view(), w2.exp_shift = d2.view(), w2.tensor_scale = t2.view();
  const mxq::Tensor wsv = pws.view();
  mxq::moe(px.view(), w13, c.bias ? &b13v : nullptr, w2, c.bias ? &b2v : nullptr, pids.view(), ptw.view(), c.act, 1.702f, 7.0f,
           py.view(), b == Backend::cuda ? &wsv : nullptr, b);
  y = py.get();
}

// The oracle, pair by pair: h = mxq::linear (the dense reference) of the token's row with its expert;
// a = mxq::moe_activation of h (itself checked against the double-precision activation within the
// contract's tolerance); o = (sum over i in index order of a_i * W2[e][n, i] in fp32) / S + b2, times the
// routing weight; y = the fp32 sum of o over the slots in slot order, rounded once.
HostTensor oracle(const Problem& p, HostTensor* a_out = nullptr) {
  const Case& c = p.c;
  const std::int64_t P = c.T * c.k, N13 = p.N13();
  HostTensor h(c.dt, P, N13);
  for (std::int64_t q = 0; q < P; ++q) {
    const std::int64_t t = q / c.k, e = id_of(p.ids, q);
    const mxq::PackedWeight we = mxq::expert(p.w13->w, e);
    const mxq::Tensor xr = mxq::Tensor::of(&p.x.bytes[t * c.H * 2], c.dt, 1, c.H);
    const mxq::Tensor hr = mxq::Tensor::of(&h.bytes[q * N13 * 2], c.dt, 1, N13);
    const mxq::Tensor br = c.bias ? mxq::Tensor::of(&p.b13.bytes[e * N13 * 2], c.dt, 1, N13) : mxq::Tensor{};
    mxq::linear(xr, we, c.bias ? &br : nullptr, hr, Backend::reference);
  }
  HostTensor a = h;
  if (c.act != MoeActivation::none) {
    a = HostTensor(c.dt, P, c.I);
    mxq::moe_activation(h.view(), c.act, 1.702f, 7.0f, a.view(), Backend::reference);
    int off = 0;
    for (std::int64_t q = 0; q < P; ++q)
      for (std::int64_t i = 0; i < c.I; ++i) {
        const bool oai = c.act == MoeActivation::swiglu_oai;
        const float g = h.get(q, oai ? 2 * i : i), u = h.get(q, oai ? 2 * i + 1 : c.I + i);
        HostTensor one(c.dt, 1, 1);
        one.set(0, 0, activation_oracle(c.act, g, u, 1.702f, 7.0f));
        // the contract: the fp32 activation may differ in its last bit, so the dtype value by one step
        const float want = one.get(0, 0), got = a.get(q, i);
        const float ulp = std::max(std::abs(want) * (c.dt == DType::bf16 ? 0x1p-7f : 0x1p-10f), 0x1p-24f);
        if (!(std::abs(want - got) <= ulp) && off++ < 8)
          ADD_FAILURE() << c.name() << ": activation (" << q << ", " << i << ") of g " << g << " u " << u << ": want " << want
                        << " got " << got;
      }
  }
  if (a_out) *a_out = a;
  std::vector<HostTensor> wd;
  for (std::int64_t e = 0; e < c.E; ++e) wd.push_back(dequantized(*p.w2, e));
  HostTensor y(c.dt, c.T, c.H);
  for (std::int64_t t = 0; t < c.T; ++t)
    for (std::int64_t n = 0; n < c.H; ++n) {
      float s = 0.0f;
      for (std::int64_t j = 0; j < c.k; ++j) {
        const std::int64_t q = t * c.k + j, e = id_of(p.ids, q);
        float acc = 0.0f;
        for (std::int64_t i = 0; i < c.I; ++i) acc += a.get(q, i) * wd[e].get(n, i);
        if (c.f == Format::nvfp4) acc = acc / p.w2->S[e];
        if (c.bias) acc = acc + p.b2.get(e, n);
        const float o = acc * p.tw.get(t, j);
        s = j == 0 ? o : s + o;
      }
      y.set(t, n, s);
    }
  return y;
}

// Bytes equal (NaN equal to any NaN); prints the first mismatches.
void expect_same(const HostTensor& want, const HostTensor& got, const std::string& what) {
  ASSERT_EQ(want.rows, got.rows);
  ASSERT_EQ(want.cols, got.cols);
  int bad = 0;
  for (std::int64_t m = 0; m < want.rows; ++m)
    for (std::int64_t n = 0; n < want.cols; ++n) {
      const float a = want.get(m, n), b = got.get(m, n);
      if (!((std::isnan(a) && std::isnan(b)) || want.bits(m, n) == got.bits(m, n)) && bad++ < 8)
        ADD_FAILURE() << what << ": y(" << m << ", " << n << ") want " << a << " got " << b;
    }
  EXPECT_EQ(bad, 0) << what << ": " << bad << " of " << want.rows * want.cols << " outputs differ";
}

std::vector<Case> grid() {
  std::vector<Case> cs;
  for (Format f : {Format::mxfp4, Format::nvfp4})
    for (DType dt : {DType::bf16, DType::f16})
      for (MoeActivation act : {MoeActivation::none, MoeActivation::swiglu, MoeActivation::swiglu_oai})
        for (auto [T, k] : {std::pair<std::int64_t, std::int64_t>{1, 1}, {7, 4}, {64, 8}, {7, 1}, {1, 8}})
          for (Routing r : {Routing::uneven, Routing::one_expert, Routing::two_experts}) {
            const std::int64_t H = f == Format::nvfp4 ? 48 : 64, I = f == Format::nvfp4 ? 16 : 32;
            cs.push_back({f, dt, act, T, k, 8, H, I, r, (T + k + int(r)) % 2 == 0});
          }
  return cs;
}

TEST(Moe, ReferenceMatchesPerPairOracle) {
  std::uint32_t seed = 1;
  for (const Case& c : grid()) {
    const Problem p = make_problem(c, seed++);
    HostTensor y;
    run_moe(Backend::reference, p, y);
    expect_same(oracle(p), y, c.name());
  }
}

TEST(Moe, IdAndWeightDtypesAndAutomaticBackend) {
  for (DType idt : {DType::i32, DType::i64})
    for (DType wdt : {DType::f32, DType::bf16, DType::f16}) {
      Case c{Format::mxfp4, DType::bf16, MoeActivation::swiglu, 7, 4, 6, 64, 32, Routing::uneven, true, wdt, idt};
      const Problem p = make_problem(c, 77);
      HostTensor y;
      run_moe(Backend::automatic, p, y);
      expect_same(oracle(p), y, c.name() + " ids " + std::string(mxq::to_string(idt)) + " weights " + std::string(mxq::to_string(wdt)));
    }
}

// Reduced: T = 4096 tokens with k = 4 through the reference against the oracle on a small H and I
// (the reference's cost is T * k * (N13 + H) * (H + I) decodes; real model widths are left to the GPU).
TEST(Moe, ManyTokensReference) {
  Case c{Format::nvfp4, DType::bf16, MoeActivation::swiglu, 4096, 4, 16, 32, 16, Routing::uneven, true};
  const Problem p = make_problem(c, 4096);
  HostTensor y;
  run_moe(Backend::reference, p, y);
  expect_same(oracle(p), y, c.name());
}

TEST(Moe, RouteGroupsPairsByExpertAscending) {
  const std::int64_t T = 7, k = 4, E = 9, P = T * k;
  for (Routing r : {Routing::uneven, Routing::one_expert, Routing::two_experts}) {
    const HostTensor ids = make_ids(r, T, k, E, 5);
    HostTensor off = i32_tensor(1, E + 1), sorted = i32_tensor(1, P), pos = i32_tensor(1, P), flag = i32_tensor(1, 1);
    mxq::moe_route(ids.view(), E, off.view(), sorted.view(), pos.view(), flag.view(), Backend::reference);
    EXPECT_EQ(geti(flag, 0), 0);
    EXPECT_EQ(geti(off, 0), 0);
    EXPECT_EQ(geti(off, E), P);
    for (std::int64_t e = 0; e < E; ++e) {
      std::int64_t count = 0;
      for (std::int64_t p = 0; p < P; ++p) count += id_of(ids, p) == e;
      EXPECT_EQ(geti(off, e + 1) - geti(off, e), count) << "expert " << e;
      for (std::int64_t q = geti(off, e); q < geti(off, e + 1); ++q) {
        EXPECT_EQ(id_of(ids, geti(sorted, q)), e);
        if (q > geti(off, e)) EXPECT_LT(geti(sorted, q - 1), geti(sorted, q)) << "ascending pair index within an expert";
      }
    }
    for (std::int64_t p = 0; p < P; ++p) EXPECT_EQ(geti(sorted, geti(pos, p)), p);
  }
}

TEST(Moe, PrimitivesChainToTheWholeOp) {
  Case c{Format::mxfp4, DType::f16, MoeActivation::swiglu_oai, 7, 4, 5, 64, 32, Routing::uneven, true};
  const Problem p = make_problem(c, 9);
  const std::int64_t P = c.T * c.k, N13 = p.N13();
  HostTensor off = i32_tensor(1, c.E + 1), sorted = i32_tensor(1, P), pos = i32_tensor(1, P), flag = i32_tensor(1, 1);
  mxq::moe_route(p.ids.view(), c.E, off.view(), sorted.view(), pos.view(), flag.view());
  HostTensor h(c.dt, P, N13), a(c.dt, P, c.I), o(DType::f32, P, c.H), y(c.dt, c.T, c.H);
  const mxq::Tensor b13 = p.b13.view(), b2 = p.b2.view(), tw = p.tw.view();
  mxq::moe_linear(p.x.view(), mxq::MoeRows::token, c.k, p.w13->w, &b13, off.view(), sorted.view(), nullptr, h.view());
  mxq::moe_activation(h.view(), c.act, 1.702f, 7.0f, a.view());
  mxq::moe_linear(a.view(), mxq::MoeRows::sorted, c.k, p.w2->w, &b2, off.view(), sorted.view(), &tw, o.view());
  mxq::moe_combine(o.view(), pos.view(), c.k, y.view());
  HostTensor whole;
  run_moe(Backend::reference, p, whole);
  expect_same(whole, y, c.name());
}

TEST(Moe, EmptyExpertsAndNoTokens) {
  // T = 0: nothing to do, nothing written, no error.
  Case c{Format::mxfp4, DType::bf16, MoeActivation::swiglu, 0, 4, 4, 64, 32, Routing::uneven, false};
  const Problem p = make_problem(c, 3);
  HostTensor y;
  run_moe(Backend::reference, p, y);
  EXPECT_EQ(y.rows, 0);
}

TEST(Moe, HostIdOutOfRangeNamesTokenAndSlot) {
  Case c{Format::mxfp4, DType::bf16, MoeActivation::swiglu, 7, 4, 8, 64, 32, Routing::uneven, false};
  for (std::int64_t bad : {std::int64_t(8), std::int64_t(-1), std::int64_t(1) << 40}) {
    c.idt = bad > (std::int64_t(1) << 31) ? DType::i64 : DType::i32;
    Problem p = make_problem(c, 4);
    seti(p.ids, 3 * c.k + 1, bad);
    HostTensor y;
    try {
      run_moe(Backend::reference, p, y);
      ADD_FAILURE() << "no error for expert id " << bad;
    } catch (const mxq::Error& e) {
      EXPECT_EQ(e.code(), mxq::Error::Code::invalid_argument);
      EXPECT_NE(std::string(e.what()).find("token 3, slot 1"), std::string::npos) << e.what();
    }
    HostTensor off = i32_tensor(1, c.E + 1), sorted = i32_tensor(1, 28), pos = i32_tensor(1, 28), flag = i32_tensor(1, 1);
    EXPECT_THROW(mxq::moe_route(p.ids.view(), c.E, off.view(), sorted.view(), pos.view(), flag.view()), mxq::Error);
  }
}

// Each call breaks one thing; the message names the argument and what was expected.
TEST(Moe, ArgumentErrorsNameTheArgument) {
  Case c{Format::mxfp4, DType::bf16, MoeActivation::swiglu, 7, 4, 4, 64, 32, Routing::uneven, true};
  const Problem p = make_problem(c, 8);
  HostTensor y(c.dt, c.T, c.H);
  const mxq::Tensor b13 = p.b13.view(), b2 = p.b2.view();
  auto expect_error = [&](const std::string& needle, auto&& call) {
    try {
      call();
      ADD_FAILURE() << "no error; expected one mentioning '" << needle << "'";
    } catch (const mxq::Error& e) {
      EXPECT_NE(std::string(e.what()).find(needle), std::string::npos) << e.what();
    }
  };
  auto call = [&](const mxq::Tensor& x, const mxq::PackedExperts& w13, const mxq::Tensor* bb13, const mxq::PackedExperts& w2,
                  const mxq::Tensor& ids, const mxq::Tensor& tw, MoeActivation act, const mxq::Tensor& yy) {
    mxq::moe(x, w13, bb13, w2, &b2, ids, tw, act, 1.702f, 7.0f, yy);
  };
  expect_error("w13: experts [64, 64], expected [32, 64]",
               [&] { call(p.x.view(), p.w13->w, nullptr, p.w2->w, p.ids.view(), p.tw.view(), MoeActivation::none, y.view()); });
  HostTensor x32 = make_x(c.dt, c.T, 32, 1);
  expect_error("w13: experts [64, 64], expected [64, 32]",
               [&] { call(x32.view(), p.w13->w, &b13, p.w2->w, p.ids.view(), p.tw.view(), c.act, y.view()); });
  HostTensor tw_bad(DType::f32, c.T, 3);
  expect_error("argument 'topk_weights': shape [7, 3], expected [7, 4]",
               [&] { call(p.x.view(), p.w13->w, &b13, p.w2->w, p.ids.view(), tw_bad.view(), c.act, y.view()); });
  HostTensor ids_f(DType::f32, c.T, c.k);
  expect_error("argument 'topk_ids': dtype f32, expected i32 or i64",
               [&] { call(p.x.view(), p.w13->w, &b13, p.w2->w, ids_f.view(), p.tw.view(), c.act, y.view()); });
  HostTensor b13_bad(c.dt, c.E, 32);
  const mxq::Tensor b13b = b13_bad.view();
  expect_error("argument 'b13': shape [4, 32], expected [4, 64]",
               [&] { call(p.x.view(), p.w13->w, &b13b, p.w2->w, p.ids.view(), p.tw.view(), c.act, y.view()); });
  HostTensor y_bad(DType::f16, c.T, c.H);
  expect_error("argument 'y': dtype f16, expected bf16",
               [&] { call(p.x.view(), p.w13->w, &b13, p.w2->w, p.ids.view(), p.tw.view(), c.act, y_bad.view()); });
  mxq::PackedExperts w2nv = p.w2->w;
  w2nv.format = Format::nvfp4;
  expect_error("argument 'w2.scales'", [&] { call(p.x.view(), p.w13->w, &b13, w2nv, p.ids.view(), p.tw.view(), c.act, y.view()); });
  const auto nv13 = make_experts(Format::nvfp4, c.E, 64, 64, 2);
  expect_error("w13.format 'nvfp4' and w2.format 'mxfp4' differ",
               [&] { call(p.x.view(), nv13->w, &b13, p.w2->w, p.ids.view(), p.tw.view(), c.act, y.view()); });
  const auto e5 = make_experts(Format::mxfp4, 5, 64, 32, 2);
  expect_error("w13.E 4 and w2.E 5 differ", [&] { call(p.x.view(), p.w13->w, &b13, e5->w, p.ids.view(), p.tw.view(), c.act, y.view()); });
  expect_error("swiglu_oai: alpha", [&] {
    mxq::moe(p.x.view(), p.w13->w, &b13, p.w2->w, &b2, p.ids.view(), p.tw.view(), MoeActivation::swiglu_oai, NAN, 7.0f, y.view());
  });
  // moe_linear's routing tensors are checked on the host before the reference reads by them
  HostTensor off = i32_tensor(1, c.E + 1), sorted = i32_tensor(1, 28), h(c.dt, 28, 64);
  for (std::int64_t e = 0; e <= c.E; ++e) seti(off, e, e == c.E ? 28 : 0);
  for (std::int64_t q = 0; q < 28; ++q) seti(sorted, q, q == 5 ? 28 : q);
  expect_error("sorted_pairs[5] = 28", [&] {
    mxq::moe_linear(p.x.view(), mxq::MoeRows::token, c.k, p.w13->w, nullptr, off.view(), sorted.view(), nullptr, h.view());
  });
  EXPECT_THROW(mxq::parse_moe_activation("gelu"), mxq::Error);
  EXPECT_EQ(mxq::parse_moe_activation("swiglu_oai"), MoeActivation::swiglu_oai);
}

TEST(Moe, WorkspaceLayout) {
  const mxq::MoeWorkspace a = mxq::moe_workspace(5, 4, 8, 64, 32, 48, MoeActivation::swiglu);
  const std::int64_t P = 20;
  EXPECT_EQ(a.expert_offsets, 0);
  EXPECT_EQ(a.sorted_pairs, 256);
  EXPECT_EQ(a.pair_pos, 512);
  EXPECT_EQ(a.error_flag, 768);
  EXPECT_EQ(a.h, 1024);
  EXPECT_EQ(a.a, 1024 + (2 * P * 64 + 255) / 256 * 256);
  EXPECT_EQ(a.o, a.a + (2 * P * 32 + 255) / 256 * 256);
  EXPECT_EQ(a.bytes, a.o + (4 * P * 48 + 255) / 256 * 256);
  const mxq::MoeWorkspace n = mxq::moe_workspace(5, 4, 8, 32, 32, 48, MoeActivation::none);
  EXPECT_EQ(n.a, n.h);
  EXPECT_EQ(n.o, n.h + (2 * P * 32 + 255) / 256 * 256);
}

TEST(Moe, PrepackExpertsMatchesPrepackPerExpert) {
  const auto x = make_experts(Format::nvfp4, 3, 40, 48, 12);
  for (std::int64_t e = 0; e < 3; ++e) {
    const mxq::PackedWeight w = mxq::expert(x->w, e);
    HostTensor codes(DType::u8, 40, 24), scales(DType::u8, 40, 3);
    mxq::unpack(w, {codes.view(), scales.view()});
    EXPECT_EQ(codes.bytes, x->codes[e].bytes);
    EXPECT_EQ(scales.bytes, x->scales[e].bytes);
    EXPECT_EQ(w.tensor_scale, x->S[e]);
    EXPECT_EQ(w.exp_shift, 8);
  }
}

// ---- CUDA -----------------------------------------------------------------------------------------------
// Activation none on exact inputs: every sum is exact in any order, so the bytes must equal.
TEST(MoeCuda, MatchesReferenceExactlyWithoutActivation) {
  TH_REQUIRE_BACKEND(Backend::cuda);
  std::uint32_t seed = 100;
  for (const Case& c : grid()) {
    if (c.act != MoeActivation::none) continue;
    const Problem p = make_problem(c, seed++);
    HostTensor want, got;
    run_moe(Backend::reference, p, want);
    run_moe(Backend::cuda, p, got);
    expect_same(want, got, c.name());
  }
}

// The SwiGLUs: the second GEMM sums inexact fp32 values in the kernel's order and the activation may
// differ in its last fp32 bit, so each output is within the bound those two allow (derived per element:
// 2 * I * 2^-24 of the sum of |products| for the order, one dtype step of each activation for the exp).
TEST(MoeCuda, MatchesReferenceWithActivationWithinTheContract) {
  TH_REQUIRE_BACKEND(Backend::cuda);
  std::uint32_t seed = 200;
  for (const Case& c : grid()) {
    if (c.act == MoeActivation::none) continue;
    const Problem p = make_problem(c, seed++);
    HostTensor want, got;
    run_moe(Backend::reference, p, want);
    run_moe(Backend::cuda, p, got);
    HostTensor a;
    expect_same(oracle(p, &a), want, c.name() + " (reference)");
    std::vector<HostTensor> wd;
    for (std::int64_t e = 0; e < c.E; ++e) wd.push_back(dequantized(*p.w2, e));
    const double step = c.dt == DType::bf16 ? 0x1p-8 : 0x1p-11;
    int bad = 0;
    for (std::int64_t t = 0; t < c.T; ++t)
      for (std::int64_t n = 0; n < c.H; ++n) {
        double mag = 0;
        for (std::int64_t j = 0; j < c.k; ++j) {
          const std::int64_t e = id_of(p.ids, t * c.k + j);
          double row = 0;
          for (std::int64_t i = 0; i < c.I; ++i) row += std::abs(double(wd[e].get(n, i)) * double(a.get(t * c.k + j, i)));
          mag += std::abs(double(p.tw.get(t, j))) * row / (c.f == Format::nvfp4 ? p.w2->S[e] : 1.0);
        }
        const double w = want.get(t, n), g = got.get(t, n);
        const double tol = mag * (2.0 * double(c.I + c.k) * 0x1p-24 + 2 * step) + std::abs(w) * step;
        // An overflow (Inf) or NaN is not within a tolerance: the same value, or a failure.
        const bool ok = std::isfinite(w) && std::isfinite(g) ? std::abs(w - g) <= tol : (w == g || (std::isnan(w) && std::isnan(g)));
        if (!ok && bad++ < 8)
          ADD_FAILURE() << c.name() << ": y(" << t << ", " << n << ") want " << want.get(t, n) << " got " << got.get(t, n)
                        << " tol " << tol;
      }
  }
}

TEST(MoeCuda, Deterministic) {
  TH_REQUIRE_BACKEND(Backend::cuda);
  Case c{Format::nvfp4, DType::bf16, MoeActivation::swiglu, 64, 8, 16, 48, 16, Routing::uneven, true};
  const Problem p = make_problem(c, 31);
  HostTensor a, b;
  run_moe(Backend::cuda, p, a);
  run_moe(Backend::cuda, p, b);
  EXPECT_EQ(a.bytes, b.bytes);
}

// Device ids out of range: the pairs are dropped (no out-of-bounds read), the workspace's flag is set,
// tokens whose slots are all in range get the reference's bytes.
TEST(MoeCuda, DeviceIdOutOfRangeSetsTheFlag) {
  TH_REQUIRE_BACKEND(Backend::cuda);
  Case c{Format::mxfp4, DType::bf16, MoeActivation::none, 7, 4, 8, 64, 32, Routing::uneven, false};
  Problem p = make_problem(c, 41);
  HostTensor want;
  run_moe(Backend::reference, p, want);
  seti(p.ids, 2 * c.k + 3, 1000);
  seti(p.ids, 5 * c.k + 0, -7);
  const std::int64_t P = c.T * c.k;
  HostTensor off = i32_tensor(1, c.E + 1), sorted = i32_tensor(1, P), pos = i32_tensor(1, P), flag = i32_tensor(1, 1);
  th::Placed pid(Backend::cuda, p.ids), po(Backend::cuda, off), ps(Backend::cuda, sorted), pp(Backend::cuda, pos),
      pf(Backend::cuda, flag);
  try {
    mxq::moe_route(pid.view(), c.E, po.view(), ps.view(), pp.view(), pf.view(), Backend::cuda);
  } catch (const mxq::Error& e) {
    if (e.code() == mxq::Error::Code::unsupported) GTEST_SKIP() << "the CUDA MoE refuses: " << e.what();
    throw;
  }
  EXPECT_NE(geti(pf.get(), 0), 0);
  EXPECT_EQ(geti(po.get(), c.E), P - 2);
  EXPECT_EQ(geti(pp.get(), 2 * c.k + 3), -1);
  EXPECT_EQ(geti(pp.get(), 5 * c.k + 0), -1);
  HostTensor got;
  run_moe(Backend::cuda, p, got);
  for (std::int64_t t = 0; t < c.T; ++t) {
    if (t == 2 || t == 5) continue;
    for (std::int64_t n = 0; n < c.H; ++n) EXPECT_EQ(want.bits(t, n), got.bits(t, n)) << "token " << t;
  }
}

}  // namespace
