// W4A16 linear: the prepacked layout (prepack, unpack), the reference (the definition) and the entry
// point that validates once and dispatches (include/mxq/linear.hpp, docs/linear.md).
#include <mxq/linear.hpp>

#include <algorithm>
#include <array>
#include <cmath>
#include <cstring>
#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "core/codec.hpp"
#include "core/linear_layout.hpp"
#include "core/linear_plan.hpp"
#include "core/validate.hpp"
#include "cpu/reference/linear_reference.hpp"
#include "entry.hpp"
#if defined(MXQ_HAVE_CUDA)
#include "cuda/backend.hpp"
#endif

namespace mxq {

namespace {

using core::Checker;

void check_format(const Checker& c, Format f) {
  if (f != Format::mxfp4 && f != Format::nvfp4)
    c.unsupported("format '" + std::string(to_string(f)) + "': the W4A16 linear takes mxfp4 or nvfp4 weights");
}

void check_dims(const Checker& c, Format f, std::int64_t N, std::int64_t K) {
  const int g = format_info(f).default_group;
  if (N < 1 || K < 1 || K % g != 0)
    c.fail("weight shape " + core::shape_str(N, K) + ": expected N >= 1 and K a positive multiple of " +
           std::to_string(g) + " (the " + std::string(to_string(f)) + " block)");
  if (N > (std::int64_t(1) << 31) || K > (std::int64_t(1) << 31))
    c.unsupported("weight shape " + core::shape_str(N, K) + ": N and K up to 2^31");
}

// Byte offsets inside the packed layout (docs/linear.md). Tile (r, a) covers rows 16r.. and columns 64a..;
// lane t = 4g + q of a warp holds rows 16r + g and 16r + g + 8, columns 64a + 16q .. 64a + 16q + 15, as
// four 32-bit words (one per mma k-step j); code p = 2 * pair + half of word j (its bits where
// core::kCodeBit says) is the element
//   row 16r + g + 8 * (pair & 1),  column 64a + 16q + 4j + 2 * (pair >> 1) + half.
struct Coord {
  std::int64_t row, col;
};
inline Coord code_coord(std::int64_t r, std::int64_t a, int lane, int j, int p) {
  const int g = lane >> 2, q = lane & 3, pair = p >> 1, half = p & 1;
  return {16 * r + g + 8 * (pair & 1), 64 * a + 16 * q + 4 * j + 2 * (pair >> 1) + half};
}
// Scale byte b (0: row 16r + g, 1: row 16r + g + 8) of slot s of tile (r, a): MXFP4 slot s = 2g + h
// covers block 2a + h (columns 64a + 32h ..); NVFP4 slot s = 4g + q covers block 4a + q.
inline Coord scale_coord(bool nv, std::int64_t r, std::int64_t a, int s, int b) {
  const int g = nv ? s >> 2 : s >> 1, h = nv ? s & 3 : s & 1;
  return {16 * r + g + 8 * b, (nv ? 4 : 2) * a + h};
}
constexpr int kTileBytes = 512;
// Whether tile (r, a) lies wholly inside the N x K weight (no padding rows or columns).
inline bool full_tile(std::int64_t r, std::int64_t a, std::int64_t N, std::int64_t K) { return 16 * r + 16 <= N && 64 * a + 64 <= K; }
// A packed word's four bytes, least significant first.
inline std::uint32_t load_word(const std::uint8_t* p) {
  return std::uint32_t(p[0]) | std::uint32_t(p[1]) << 8 | std::uint32_t(p[2]) << 16 | std::uint32_t(p[3]) << 24;
}
inline void store_word(std::uint8_t* p, std::uint32_t w) {
  for (int b = 0; b < 4; ++b) p[b] = std::uint8_t(w >> (8 * b));
}
// Prepack and unpack split their loops over threads (OpenMP, where built in) from this many weights on.
constexpr std::int64_t kParallelWeights = std::int64_t(1) << 20;

// kPairBits[pair][v]: the word bits of pair `pair`'s two codes when byte v of the codes holds them (low
// nibble: half 0, the even column; high nibble: half 1). A full tile's word j of lane (g, q) is then four
// lookups: bytes (64a + 16q + 4j) / 2 + {0, 1} of rows 16r + g (pairs 0, 2) and 16r + g + 8 (pairs 1, 3).
const std::array<std::array<std::uint32_t, 256>, 4> kPairBits = [] {
  std::array<std::array<std::uint32_t, 256>, 4> t{};
  for (int pair = 0; pair < 4; ++pair)
    for (unsigned v = 0; v < 256; ++v) t[pair][v] = core::pack_code_bits(core::pack_code_bits(0, pair, 0, v & 15u), pair, 1, v >> 4);
  return t;
}();

inline std::uint8_t get_code(const Tensor& codes, std::int64_t row, std::int64_t col) {
  const std::uint8_t byte = static_cast<const std::uint8_t*>(codes.data)[row * codes.stride() + col / 2];
  return (col & 1) ? byte >> 4 : byte & 15;
}

std::uint16_t bf16_rn(float v) {
  std::uint32_t u;
  std::memcpy(&u, &v, 4);
  if ((u & 0x7FFFFFFFu) > 0x7F800000u) return 0x7FC0;
  u += 0x7FFFu + ((u >> 16) & 1u);  // RNE; overflow carries into the infinity pattern
  return static_cast<std::uint16_t>(u >> 16);
}
std::uint16_t f16_rn(float v) {
  const _Float16 h = static_cast<_Float16>(v);  // IEEE round to nearest even, overflow to infinity
  std::uint16_t b;
  std::memcpy(&b, &h, 2);
  return b;
}
float to_f32(const void* base, DType dt, std::int64_t i) {
  const std::uint16_t b = static_cast<const std::uint16_t*>(base)[i];
  return dt == DType::bf16 ? core::bf16_to_f32(b) : core::f16_to_f32(b);
}

// The exact fp32 value of element (n, k) of the weight: e2m1 * block scale (NaN for a NaN scale).
struct WeightDecoder {
  const PackedWeight& w;
  bool nv;
  std::int64_t katoms;
  float value(std::int64_t n, std::int64_t k) const {
    const std::int64_t r = n / 16, a = k / 64;
    const int kin = int(k % 64), nin = int(n % 16);
    const int q = kin / 16, j = (kin % 16) / 4, c = kin % 4;
    const int g = nin % 8, b = nin / 8;
    const int lane = 4 * g + q, pair = b | ((c >> 1) << 1), half = c & 1;
    const std::int64_t tile = r * katoms + a;
    const std::uint32_t word = load_word(static_cast<const std::uint8_t*>(w.codes.data) + tile * kTileBytes + lane * 16 + j * 4);
    const std::uint32_t code = core::unpack_code_bits(word, pair, half);
    const int slot = nv ? lane : 2 * g + q / 2;
    const std::uint8_t sb = static_cast<const std::uint8_t*>(w.scales.data)[tile * (nv ? 64 : 32) + 2 * slot + b];
    const float e = core::decode_f32(code, core::spec_e2m1());
    float s;
    if (nv) {
      s = core::decode_f32(sb, core::spec_e4m3());
    } else {
      s = sb == 0xFF ? std::nanf("") : std::ldexp(1.0f, int(sb) - 127);
    }
    return e * s;  // exact: a 2-bit significand times a power of two or a 4-bit one
  }
};

void check_packed(Checker& c, const PackedWeight& w, Device dev) {
  check_format(c, w.format);
  check_dims(c, w.format, w.N, w.K);
  const PackedLayout L = packed_layout(w.format, w.N, w.K);
  c.view("w.codes", w.codes, DType::u8, L.codes.rows, L.codes.cols, true);
  c.view("w.scales", w.scales, DType::u8, L.scales.rows, L.scales.cols, true);
  c.same_device("w.codes", w.codes, dev);
  c.same_device("w.scales", w.scales, dev);
  if (w.format == Format::nvfp4 && !(std::isfinite(w.tensor_scale) && w.tensor_scale > 0))
    c.fail("w.tensor_scale " + std::to_string(w.tensor_scale) + ": expected the NVFP4 encode scale S, finite and > 0");
  if (w.format == Format::nvfp4 && w.exp_shift != 8)
    c.fail("w.exp_shift " + std::to_string(w.exp_shift) + ": prepack sets 8 for nvfp4");
  if (w.format == Format::mxfp4 && (w.exp_shift < -128 || w.exp_shift > 127))
    c.fail("w.exp_shift " + std::to_string(w.exp_shift) + ": prepack sets max E8M0 - 128, in [-128, 127]");
}

}  // namespace

PackedLayout packed_layout(Format format, std::int64_t N, std::int64_t K) {
  Checker c("packed_layout");
  check_format(c, format);
  check_dims(c, format, N, K);
  PackedLayout L;
  L.N = N;
  L.K = K;
  L.Np = (N + 31) / 32 * 32;
  L.Kp = (K + 63) / 64 * 64;
  const std::int64_t tiles = (L.Np / 16) * (L.Kp / 64);
  L.codes = {tiles, kTileBytes};
  L.scales = {tiles, format == Format::nvfp4 ? 64 : 32};
  return L;
}

void prepack(const QuantizedIn& q, const QuantOptions& opt, PackedWeight& out) {
  Checker c("prepack");
  check_format(c, opt.format);
  if (out.format != opt.format)
    c.fail("out.format '" + std::string(to_string(out.format)) + "' differs from opt.format '" +
           std::string(to_string(opt.format)) + "'");
  const int g = group_size(opt);
  if (g != format_info(opt.format).default_group)
    c.unsupported("group size " + std::to_string(g) + ": the W4A16 linear takes " + std::string(to_string(opt.format)) +
                  " with its standard block of " + std::to_string(format_info(opt.format).default_group));
  if (opt.rotation != Rotation::none)
    c.unsupported("option 'rotation': prepack takes unrotated weights (apply the rotation to x instead)");
  const std::int64_t N = out.N, K = out.K;
  check_dims(c, opt.format, N, K);
  c.view("q.codes", q.codes, DType::u8, N, code_cols(opt.format, K));
  const Shape2 ss = scale_shape(opt, N, K);
  c.view("q.scales", q.scales, DType::u8, ss.rows, ss.cols, opt.scale_layout == ScaleLayout::swizzled);
  const PackedLayout L = packed_layout(opt.format, N, K);
  c.view("out.codes", out.codes, DType::u8, L.codes.rows, L.codes.cols, true);
  c.view("out.scales", out.scales, DType::u8, L.scales.rows, L.scales.cols, true);
  for (auto [arg, t] : {std::pair{"q.codes", &q.codes}, {"q.scales", &q.scales}, {"out.codes", &out.codes}, {"out.scales", &out.scales}})
    if (t->device != Device::cpu) c.fail(std::string(arg) + ": prepack runs on the host; pass host memory");
  c.record("q.codes", q.codes, false);
  c.record("q.scales", q.scales, false);
  c.record("out.codes", out.codes, true);
  c.record("out.scales", out.scales, true);
  c.no_overlap();

  const bool nv = opt.format == Format::nvfp4;
  const std::int64_t G = K / g, Cp = (G + 3) / 4 * 4;
  const auto* sc = static_cast<const std::uint8_t*>(q.scales.data);
  auto scale_at = [&](std::int64_t row, std::int64_t grp) -> std::uint8_t {
    return opt.scale_layout == ScaleLayout::swizzled ? sc[swizzled_offset(row, grp, Cp)] : sc[row * q.scales.stride() + grp];
  };
  auto block_nonzero = [&](std::int64_t row, std::int64_t grp) {
    for (std::int64_t k = grp * g; k < (grp + 1) * g; ++k)
      if (get_code(q.codes, row, k) & 7) return true;
    return false;
  };

  // The loops below run over rows (of W, or of 16-row tiles) in parallel where OpenMP is built in: every
  // iteration writes its own bytes, and the results do not depend on the number of threads.
  // MXFP4's shift d: the largest finite E8M0 byte maps to the top of bf16's exponent range.
  int emax = -1;
  if (!nv) {
#if defined(MXQ_HAVE_OPENMP)
#pragma omp parallel for schedule(static) reduction(max : emax) if (N * K >= kParallelWeights)
#endif
    for (std::int64_t n = 0; n < N; ++n)
      for (std::int64_t j = 0; j < G; ++j)
        if (const int b = scale_at(n, j); b != 0xFF) emax = std::max(emax, b);
  }
  if (emax < 0) emax = 127;
  const int d = nv ? 8 : emax - 128;
  bool f16_exact = true;
  if (!nv) {
    // The first (row-major) non-zero block whose scale is too far below emax, if any, is refused.
    std::int64_t first_bad = N * G;
    int f16_ok = 1;
#if defined(MXQ_HAVE_OPENMP)
#pragma omp parallel for schedule(static) reduction(min : first_bad) reduction(min : f16_ok) if (N * K >= kParallelWeights)
#endif
    for (std::int64_t n = 0; n < N; ++n)
      for (std::int64_t j = 0; j < G; ++j) {
        const int b = scale_at(n, j);
        if (b == 0xFF || !block_nonzero(n, j)) continue;
        // The kernel's operand e2m1 * 2^(b - emax + 1) must lie on bf16's grid (2^-133): b >= emax - 133.
        if (b < emax - 133) first_bad = std::min(first_bad, n * G + j);
        if (b < emax - 24) f16_ok = 0;
      }
    if (first_bad < N * G) {
      const std::int64_t n = first_bad / G, j = first_bad % G;
      c.unsupported("weight block (" + std::to_string(n) + ", " + std::to_string(j) + ") has E8M0 scale " +
                    std::to_string(scale_at(n, j)) + " while another block's is " + std::to_string(emax) +
                    ": non-zero blocks whose scales span more than 2^133 are not exact in bf16");
    }
    f16_exact = f16_ok != 0;
  }

  const std::int64_t katoms = L.Kp / 64, rtiles = L.Np / 16;
  auto* oc = static_cast<std::uint8_t*>(out.codes.data);
  auto* os = static_cast<std::uint8_t*>(out.scales.data);
  const int slots = nv ? 32 : 16;
  const std::uint8_t neutral = nv ? 0x38 : std::uint8_t(emax);  // 1.0 / the largest scale: a normal multiplier
#if defined(MXQ_HAVE_OPENMP)
#pragma omp parallel for schedule(static) if (N * K >= kParallelWeights)
#endif
  for (std::int64_t r = 0; r < rtiles; ++r)
    for (std::int64_t a = 0; a < katoms; ++a) {
      const std::int64_t tile = r * katoms + a;
      std::uint8_t* t = oc + tile * kTileBytes;
      const bool full = full_tile(r, a, N, K);
      for (int lane = 0; lane < 32; ++lane)
        for (int j = 0; j < 4; ++j) {
          std::uint32_t word = 0;
          if (full) {
            const std::uint8_t* r0 = static_cast<const std::uint8_t*>(q.codes.data) +
                                     (16 * r + (lane >> 2)) * q.codes.stride() + 32 * a + 8 * (lane & 3) + 2 * j;
            const std::uint8_t* r1 = r0 + 8 * q.codes.stride();
            word = kPairBits[0][r0[0]] | kPairBits[1][r1[0]] | kPairBits[2][r0[1]] | kPairBits[3][r1[1]];
          } else {
            for (int p = 0; p < 8; ++p) {
              const Coord cc = code_coord(r, a, lane, j, p);
              if (cc.row < N && cc.col < K) word = core::pack_code_bits(word, p >> 1, p & 1, get_code(q.codes, cc.row, cc.col));
            }
          }
          store_word(t + lane * 16 + j * 4, word);
        }
      std::uint8_t* s = os + tile * (2 * slots);
      for (int slot = 0; slot < slots; ++slot)
        for (int b = 0; b < 2; ++b) {
          const Coord cc = scale_coord(nv, r, a, slot, b);
          s[2 * slot + b] = (cc.row < N && cc.col < G) ? scale_at(cc.row, cc.col) : neutral;
        }
    }
  out.exp_shift = d;
  out.f16_exact = f16_exact;
}

void unpack(const PackedWeight& w, const QuantizedIn& q) {
  Checker c("unpack");
  check_packed(c, w, Device::cpu);
  c.view("q.codes", q.codes, DType::u8, w.N, code_cols(w.format, w.K));
  const std::int64_t G = w.K / format_info(w.format).default_group;
  c.view("q.scales", q.scales, DType::u8, w.N, G);
  c.same_device("q.codes", q.codes, Device::cpu);
  c.same_device("q.scales", q.scales, Device::cpu);
  c.record("w.codes", w.codes, false);
  c.record("w.scales", w.scales, false);
  c.record("q.codes", q.codes, true);
  c.record("q.scales", q.scales, true);
  c.no_overlap();
  const bool nv = w.format == Format::nvfp4;
  const PackedLayout L = packed_layout(w.format, w.N, w.K);
  const std::int64_t katoms = L.Kp / 64;
  const auto* pc = static_cast<const std::uint8_t*>(w.codes.data);
  const auto* ps = static_cast<const std::uint8_t*>(w.scales.data);
  auto* oc = static_cast<std::uint8_t*>(q.codes.data);
  auto* os = static_cast<std::uint8_t*>(q.scales.data);
  const int slots = nv ? 32 : 16;
  // Tile row r writes rows 16r .. 16r + 15 of q only (both nibbles of a byte are in one row): the tile rows
  // can go in parallel.
#if defined(MXQ_HAVE_OPENMP)
#pragma omp parallel for schedule(static) if (w.N * w.K >= kParallelWeights)
#endif
  for (std::int64_t r = 0; r < L.Np / 16; ++r)
    for (std::int64_t a = 0; a < katoms; ++a) {
      const std::int64_t tile = r * katoms + a;
      if (full_tile(r, a, w.N, w.K)) {
        // A full tile: word j of lane (g, q) fills bytes (64a + 16q + 4j) / 2 + {0, 1} of rows 16r + g and
        // 16r + g + 8 (the inverse of prepack's kPairBits).
        for (int lane = 0; lane < 32; ++lane)
          for (int j = 0; j < 4; ++j) {
            const std::uint32_t word = load_word(pc + tile * kTileBytes + lane * 16 + j * 4);
            const auto two = [&](int pair) {
              return std::uint8_t(core::unpack_code_bits(word, pair, 0) | core::unpack_code_bits(word, pair, 1) << 4);
            };
            std::uint8_t* o0 = oc + (16 * r + (lane >> 2)) * q.codes.stride() + 32 * a + 8 * (lane & 3) + 2 * j;
            std::uint8_t* o1 = o0 + 8 * q.codes.stride();
            o0[0] = two(0);
            o1[0] = two(1);
            o0[1] = two(2);
            o1[1] = two(3);
          }
      } else {
        for (int lane = 0; lane < 32; ++lane)
          for (int j = 0; j < 4; ++j) {
            const std::uint32_t word = load_word(pc + tile * kTileBytes + lane * 16 + j * 4);
            for (int p = 0; p < 8; ++p) {
              const Coord cc = code_coord(r, a, lane, j, p);
              if (cc.row >= w.N || cc.col >= w.K) continue;
              const std::uint8_t nib = std::uint8_t(core::unpack_code_bits(word, p >> 1, p & 1));
              std::uint8_t& byte = oc[cc.row * q.codes.stride() + cc.col / 2];
              byte = (cc.col & 1) ? std::uint8_t((byte & 0x0F) | (nib << 4)) : std::uint8_t((byte & 0xF0) | nib);
            }
          }
      }
      for (int slot = 0; slot < slots; ++slot)
        for (int b = 0; b < 2; ++b) {
          const Coord cc = scale_coord(nv, r, a, slot, b);
          if (cc.row < w.N && cc.col < G) os[cc.row * q.scales.stride() + cc.col] = ps[tile * 2 * slots + 2 * slot + b];
        }
    }
}

void dequantize_packed(const PackedWeight& w, const Tensor& out, Backend backend, void* stream) {
  Checker c("dequantize_packed");
  if (out.dtype != DType::bf16 && out.dtype != DType::f16)
    c.fail("out: dtype " + std::string(to_string(out.dtype)) + ", expected bf16 or f16");
  check_packed(c, w, out.device);
  c.view("out", out, out.dtype, w.N, w.K, true);
  if (out.dtype == DType::f16 && !w.f16_exact)
    c.unsupported("out: f16 for an mxfp4 weight whose block scales span more than 2^24; use bf16");
  c.record("w.codes", w.codes, false);
  c.record("w.scales", w.scales, false);
  c.record("out", out, true);
  c.no_overlap();
  const Backend b = detail::choose("dequantize_packed", nullptr, out,
                                   {{"out", out.data}, {"w.codes", w.codes.data}, {"w.scales", w.scales.data}}, backend,
                                   /*host_is_reference=*/true);
#if defined(MXQ_HAVE_CUDA)
  if (b == Backend::cuda) return cuda::dequantize_packed(w, out, stream);
#endif
  (void)b;
  (void)stream;
  const WeightDecoder dec{w, w.format == Format::nvfp4, packed_layout(w.format, w.N, w.K).Kp / 64};
  auto* o = static_cast<std::uint16_t*>(out.data);
  for (std::int64_t n = 0; n < w.N; ++n)
    for (std::int64_t k = 0; k < w.K; ++k) {
      const float v = std::ldexp(dec.value(n, k), -w.exp_shift);  // exact, in the dtype (prepack's checks)
      o[n * w.K + k] = out.dtype == DType::bf16 ? bf16_rn(v) : f16_rn(v);
    }
}

namespace {
int current_device_sm() {
#if defined(MXQ_HAVE_CUDA)
  if (cuda::available(nullptr)) return cuda::device_sm();
#endif
  return 90;
}
}  // namespace

std::string linear_plan(const PackedWeight& w, std::int64_t M, int sm) {
  Checker c("linear_plan");
  check_format(c, w.format);
  check_dims(c, w.format, w.N, w.K);
  if (M < 1) c.fail("M " + std::to_string(M) + ": expected >= 1");
  if (sm < 0 || sm > 1000) c.fail("sm " + std::to_string(sm) + ": expected 0 (the current device) or a compute capability such as 90");
  if (sm == 0) sm = current_device_sm();
#if defined(MXQ_HAVE_SM90A)
  constexpr bool sm90a = true;  // this build holds the sm90a prefill kernels
#else
  constexpr bool sm90a = false;
#endif
  return core::to_string(core::plan_linear(w.N, w.K, M, sm, sm == 90 && sm90a && !core::wgmma_disabled_by_env()));
}

void linear(const Tensor& x, const PackedWeight& w, const Tensor* bias, const Tensor& y, Backend backend, void* stream) {
  Checker c("linear");
  if (x.dtype != DType::bf16 && x.dtype != DType::f16)
    c.fail("x: dtype " + std::string(to_string(x.dtype)) + ", expected bf16 or f16");
  check_packed(c, w, x.device);
  if (x.cols != w.K) c.fail("x: shape " + core::shape_str(x.rows, x.cols) + ", expected K = " + std::to_string(w.K) + " columns (the weight's K)");
  c.view("x", x, x.dtype, x.rows, w.K);
  c.view("y", y, x.dtype, x.rows, w.N);
  c.same_device("y", y, x.device);
  if (bias) {
    c.view("bias", *bias, x.dtype, 1, w.N);
    c.same_device("bias", *bias, x.device);
  }
  if (x.dtype == DType::f16 && !w.f16_exact)
    c.unsupported("x: f16 activations with an mxfp4 weight whose block scales span more than 2^24 (not exact in "
                  "fp16's range); use bf16 activations");
  c.record("x", x, false);
  c.record("w.codes", w.codes, false);
  c.record("w.scales", w.scales, false);
  if (bias) c.record("bias", *bias, false);
  c.record("y", y, true);
  c.no_overlap();
  // Backend::cpu runs the reference: it is the host implementation of this operation.
  const Backend b = detail::choose("linear", nullptr, x,
                                   {{"x", x.data}, {"y", y.data}, {"w.codes", w.codes.data}, {"w.scales", w.scales.data},
                                    {"bias", bias ? bias->data : nullptr}},
                                   backend, /*host_is_reference=*/true);
  if (x.rows == 0) return;
#if defined(MXQ_HAVE_CUDA)
  if (b == Backend::cuda) {
    if (reinterpret_cast<std::uintptr_t>(x.data) % 16 != 0 || (x.stride() * 2) % 16 != 0)
      c.unsupported("x: the CUDA kernel reads x in 16-byte vectors; its data pointer and row stride (" +
                    std::to_string(x.stride()) + " elements) must be 16-byte aligned");
    for (const auto& [name, t] : {std::pair<const char*, const Tensor*>{"w.codes", &w.codes}, {"w.scales", &w.scales}})
      if (reinterpret_cast<std::uintptr_t>(t->data) % 16 != 0)
        c.unsupported(std::string(name) + ": the CUDA kernels read the packed weight in 16-byte vectors; its data pointer must be "
                      "16-byte aligned (prepack's buffers are)");
    return cuda::linear(x, w, bias, y, stream);
  }
#endif
  // The reference: exact products, fp32 sums in index order, then / S (NVFP4), + bias, rounded once.
  (void)b;
  (void)stream;
  std::vector<float> acc(static_cast<std::size_t>(x.rows * w.N));
  ref::linear_f32(x, nullptr, x.rows, w, bias, acc.data());
  auto* yo = static_cast<std::uint16_t*>(y.data);
  for (std::int64_t m = 0; m < x.rows; ++m)
    for (std::int64_t n = 0; n < w.N; ++n) {
      const float v = acc[static_cast<std::size_t>(m * w.N + n)];
      yo[m * y.stride() + n] = x.dtype == DType::bf16 ? bf16_rn(v) : f16_rn(v);
    }
}

void ref::linear_f32(const Tensor& x, const std::int64_t* rows, std::int64_t nrows, const PackedWeight& w, const Tensor* bias,
                     float* out) {
  const bool nv = w.format == Format::nvfp4;
  const WeightDecoder dec{w, nv, packed_layout(w.format, w.N, w.K).Kp / 64};
  std::vector<float> wrow(static_cast<std::size_t>(w.K));
  for (std::int64_t n = 0; n < w.N; ++n) {
    for (std::int64_t k = 0; k < w.K; ++k) wrow[k] = dec.value(n, k);
    const float bn = bias ? to_f32(bias->data, x.dtype, n) : 0.0f;
    for (std::int64_t i = 0; i < nrows; ++i) {
      const std::int64_t m = rows ? rows[i] : i;
      float acc = 0.0f;
      for (std::int64_t k = 0; k < w.K; ++k) acc += to_f32(x.data, x.dtype, m * x.stride() + k) * wrow[k];
      if (nv) acc = acc / w.tensor_scale;
      out[i * w.N + n] = acc + bn;
    }
  }
}

}  // namespace mxq
