// nvfp4_e5m3 quantize, QDQ and dequantize on the fast CPU path (cpu/quantize/e5m3.hpp).
#include "cpu/quantize/e5m3.hpp"

#include "cpu/common/vector_io.hpp"

namespace mxq::cpu {
namespace {

using namespace mxq::core;

constexpr int kMaxGroup = 32;  // the format's group sizes: 16, 32

// Block b of row r staged to fp32 (zero past K), and its scale byte.
template <DType DT>
MXQ_INLINE std::uint32_t stage_block(const Problem& p, const Tensor& x, std::int64_t r, std::int64_t b, float* xf) {
  load_block<DT, 0>(x, r, b * p.g, p.K, p.g, xf);
  std::uint32_t amax = 0;  // fp32 bits of max |x|; a NaN element wins the integer maximum, as in torch's amax
  for (int i = 0; i < p.g; ++i) amax = std::max(amax, f2u(xf[i]) & 0x7FFFFFFFu);
  return nvfp4_e5m3_scale_code(amax);
}

template <DType DT>
void quantize_tile(const Problem& p, const Tensor& x, const QuantizedOut& out, std::int64_t r, std::int64_t b0,
                   std::int64_t b1) {
  float xf[kMaxGroup];
  std::uint8_t sb[kTileBlocks];
  std::uint8_t* codes = static_cast<std::uint8_t*>(out.codes.data) + r * out.codes.stride();
  std::uint8_t* mask = out.clip_mask.data ? static_cast<std::uint8_t*>(out.clip_mask.data) + r * out.clip_mask.stride() : nullptr;
  for (std::int64_t b = b0; b < b1; ++b) {
    const std::uint32_t sc = stage_block<DT>(p, x, r, b, xf);
    sb[b - b0] = static_cast<std::uint8_t>(sc);
    // Two codes a byte, element 2i low; the padding past K is +0 (code 0), so an odd K's last high nibble is 0.
    const std::int64_t k0 = b * p.g, n = std::min<std::int64_t>(p.g, p.K - k0);
    for (std::int64_t i = 0; i < (n + 1) / 2; ++i)
      codes[k0 / 2 + i] = static_cast<std::uint8_t>(nvfp4_e5m3_code(f2u(xf[2 * i]), sc) |
                                                    (nvfp4_e5m3_code(f2u(xf[2 * i + 1]), sc) << 4));
    if (mask)  // whole bytes (k0 is a multiple of 8), the bits past K 0
      for (std::int64_t j = 0; j < (n + 7) / 8; ++j) {
        std::uint32_t bits = 0;
        for (std::int64_t i = 0; i < 8 && 8 * j + i < n; ++i) bits |= std::uint32_t(nvfp4_e5m3_kept(f2u(xf[8 * j + i]), sc)) << i;
        mask[k0 / 8 + j] = static_cast<std::uint8_t>(bits);
      }
  }
  store_scales(p, static_cast<std::uint8_t*>(out.scales.data), out.scales.stride(), r, b0, sb, b1 - b0);
}

template <DType DT>
void qdq_tile(const Problem& p, const Tensor& x, const Tensor& y, std::int64_t r, std::int64_t b0, std::int64_t b1) {
  float xf[kMaxGroup];
  std::uint32_t o[kMaxGroup];
  for (std::int64_t b = b0; b < b1; ++b) {
    const std::uint32_t sc = stage_block<DT>(p, x, r, b, xf);
    const std::int64_t k0 = b * p.g, n = std::min<std::int64_t>(p.g, p.K - k0);
    for (std::int64_t i = 0; i < n; ++i) o[i] = nvfp4_e5m3_qdq_bits(f2u(xf[i]), sc, DT);
    store_out<DT>(row_ptr(y, r), k0, n, o);  // after the block's loads: y may be x itself
  }
}

template <DType DT>
void dequantize_tile(const Problem& p, const QuantizedIn& q, const Tensor& y, std::int64_t r, std::int64_t b0,
                     std::int64_t b1) {
  const std::uint8_t* codes = static_cast<const std::uint8_t*>(q.codes.data) + r * q.codes.stride();
  const std::uint8_t* scales = static_cast<const std::uint8_t*>(q.scales.data);
  std::uint32_t o[kMaxGroup];
  for (std::int64_t b = b0; b < b1; ++b) {
    const std::uint32_t sc = scales[p.scale_offset(r, b, q.scales.stride())];
    std::uint32_t value[16];  // the block's output for each of the 16 codes
    for (std::uint32_t c = 0; c < 16; ++c) value[c] = nvfp4_e5m3_out_bits(c, sc, DT);
    const std::int64_t k0 = b * p.g, n = std::min<std::int64_t>(p.g, p.K - k0);
    for (std::int64_t i = 0; i < n; ++i) o[i] = value[(codes[(k0 + i) / 2] >> (4 * ((k0 + i) % 2))) & 0xF];
    store_out<DT>(row_ptr(y, r), k0, n, o);
  }
}

}  // namespace

void quantize_e5m3(const Problem& p, const Tensor& x, const QuantizedOut& out) {
  dispatch_dtype(x.dtype, [&](auto dt) {
    parallel_tiles(p.rows, p.nblocks, [&](std::int64_t r, std::int64_t b0, std::int64_t b1) {
      quantize_tile<decltype(dt)::value>(p, x, out, r, b0, b1);
    });
  });
}

void qdq_e5m3(const Problem& p, const Tensor& x, const Tensor& y) {
  dispatch_dtype(x.dtype, [&](auto dt) {
    parallel_tiles(p.rows, p.nblocks, [&](std::int64_t r, std::int64_t b0, std::int64_t b1) {
      qdq_tile<decltype(dt)::value>(p, x, y, r, b0, b1);
    });
  });
}

void dequantize_e5m3(const Problem& p, const QuantizedIn& q, const Tensor& y) {
  dispatch_dtype(y.dtype, [&](auto dt) {
    parallel_tiles(p.rows, p.nblocks, [&](std::int64_t r, std::int64_t b0, std::int64_t b1) {
      dequantize_tile<decltype(dt)::value>(p, q, y, r, b0, b1);
    });
  });
}

}  // namespace mxq::cpu
