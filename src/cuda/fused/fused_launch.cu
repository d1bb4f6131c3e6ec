// The fused producer ops: RMSNorm and SiLU-and-multiply, each optionally followed by a QDQ of its
// output in the same kernel (docs/numerics.md, "Fused producers"). One 256-thread block per row; thread t owns
// the 8-element chunks t, t + 256, ... of the row (the order core/fused_math.hpp defines the RMSNorm
// sum in), and the g / 8 lanes of a QDQ group are adjacent lanes of one warp.
#include <string>

#include "core/fastmath.hpp"
#include "core/format_traits.hpp"
#include "core/fused_math.hpp"
#include "core/dispatch.hpp"
#include "cuda/backend.hpp"
#include "cuda/common/device.hpp"
#include "cuda/common/vector_io.cuh"

namespace mxq::cuda {
namespace {

constexpr int kChunk = core::kNormChunk;
static_assert(core::kNormLanes == kThreads, "a block's threads are the lanes of the RMSNorm sum order");
static_assert(kChunk == 8, "a thread's chunk is 8 elements: groups of g >= 8 span g / 8 lanes");

enum class Qdq { none, mx, nvfp4 };
// The kernel's QDQ: none, NVFP4, or an MX format with its element type at compile time.
struct NoElem {};

struct FusedParams {
  const std::uint8_t* a = nullptr;  // x (rms_norm) or gate (silu_mul)
  const std::uint8_t* b = nullptr;  // weight (one row) or up
  std::uint8_t* y = nullptr;
  i64 a_stride = 0, b_stride = 0, y_stride = 0;  // bytes; b_stride 0 for the weight row
  i64 K = 0, cpr = 0;                            // chunks per row
  int iters = 0;                                 // ceil(cpr / kThreads), uniform over the block
  bool vec = false;                              // every view 16-byte aligned, K % 8 == 0
  float eps = 0.0f;
  // QDQ
  int g = 32;
  ScaleRule rule = ScaleRule::floor;
  FloatSpec elem{};
  float S = 1.0f;
};

template <DType DT>
__device__ __forceinline__ void load8(const std::uint8_t* row, i64 k0, const FusedParams& p, float (&v)[kChunk]) {
  using St = Storage<DT>;
  if (p.vec) {
    constexpr int W = vec_words<DT, kChunk>();
    u32 w[W];
#pragma unroll
    for (int q = 0; q < W / 4; ++q) {
      const uint4 u = __ldg(reinterpret_cast<const uint4*>(row + k0 * sizeof(St)) + q);
      w[4 * q] = u.x, w[4 * q + 1] = u.y, w[4 * q + 2] = u.z, w[4 * q + 3] = u.w;
    }
    u32 xb[kChunk];
    unpack_words<DT, kChunk>(w, xb);
#pragma unroll
    for (int j = 0; j < kChunk; ++j) v[j] = u2f(xb[j]);
  } else {
#pragma unroll
    for (int j = 0; j < kChunk; ++j)
      v[j] = k0 + j < p.K ? u2f(to_f32_bits<DT>(reinterpret_cast<const St*>(row)[k0 + j])) : 0.0f;
  }
}

template <DType DT>
__device__ __forceinline__ void store8(std::uint8_t* row, i64 k0, const FusedParams& p, const u32 (&o)[kChunk]) {
  using St = Storage<DT>;
  if (p.vec) {
    constexpr int W = vec_words<DT, kChunk>();
    u32 w[W];
#pragma unroll
    for (int j = 0; j < W; ++j) w[j] = DT == DType::f32 ? o[j] : (o[2 * j] & 0xFFFFu) | (o[2 * j + 1] << 16);
    store_words<W>(row + k0 * sizeof(St), w);
  } else {
#pragma unroll
    for (int j = 0; j < kChunk; ++j)
      if (k0 + j < p.K) reinterpret_cast<St*>(row)[k0 + j] = static_cast<St>(o[j]);
  }
}

// pairwise_sum of n <= 8 values (n a power of two), in place.
__device__ __forceinline__ float chunk_sum(float* v, int n) {
  for (int w = n; w > 1; w >>= 1)
    for (int i = 0; i < w / 2; ++i) v[i] = add_rn(v[2 * i], v[2 * i + 1]);
  return v[0];
}

// Sum over the lanes of one group of `lanes` adjacent lanes (a power of two <= 32), pairwise_sum's order.
__device__ __forceinline__ float lanes_sum(float s, int lanes) {
#pragma unroll
  for (int st = 1; st < 32; st <<= 1)
    if (st < lanes) s = add_rn(s, __shfl_xor_sync(kFull, s, st));
  return s;
}

// QDQ of one group of n values v[0 .. n) held by this thread, whose group spans `lanes` lanes (n = 8
// then; lanes = 1 when the group lies inside the chunk): the reference's quantize then dequantize,
// element by element, with the block statistics combined over the lanes.
template <DType DT, Qdq Q, ElemType ET>
__device__ __forceinline__ void qdq_group(const float* v, int n, int lanes, const FusedParams& p, u32* out) {
  float amax = 0.0f;
  bool bad = false;
  for (int j = 0; j < n; ++j) {
    if (!is_finite_bits(f2u(v[j]))) bad = true;
    else amax = fmaxf(amax, fabsf(v[j]));
  }
#pragma unroll
  for (int st = 1; st < 32; st <<= 1)
    if (st < lanes) {
      amax = fmaxf(amax, __shfl_xor_sync(kFull, amax, st));
      bad = __shfl_xor_sync(kFull, int(bad), st) != 0 || bad;
    }
  if constexpr (Q == Qdq::nvfp4) {
    const u32 sc = bad ? u32(kE4M3NaN) : nvfp4_block_scale_code(amax, p.S);
    const float m = bad ? 0.0f : nvfp4_multiplier(sc, p.S);
    for (int j = 0; j < n; ++j) {
      const u32 code = bad ? 0u : nvfp4_encode(f2u(v[j]), m);
      out[j] = f32_to_dtype_bits(nvfp4_decode(code, sc, p.S), DT);
    }
  } else {
    constexpr FloatSpec kSpec = Elem<ET>::spec;
    int e = -127;
    if (p.rule == ScaleRule::quest) {
      // quest_arg over the whole group (padding zeros included), sums in pairwise_sum's order; the
      // shuffles run on every lane (uniform), the result is used only for a finite, non-zero block.
      float loc[kChunk];
      for (int j = 0; j < n; ++j) loc[j] = v[j];
      const float mean = div_rn(lanes_sum(chunk_sum(loc, n), lanes), float(p.g));
      for (int j = 0; j < n; ++j) {
        const float d = sub_rn(v[j], mean);
        loc[j] = mul_rn(d, d);
      }
      const float var = div_rn(lanes_sum(chunk_sum(loc, n), lanes), float(p.g));
      const float q = add_rn(div_rn(mul_rn(sqrt_rn(var), 2.92247856f), 6.0f), 1e-8f);
      if (!bad && amax > 0.0f) e = mx_scale_exp(p.rule, amax, q, kSpec);
    } else if (!bad && amax > 0.0f) {
      e = mx_scale_exp(p.rule, amax, 0.0f, kSpec);
    }
    if (bad) {
      for (int j = 0; j < n; ++j) out[j] = nan_bits(DT);
      return;
    }
    // the general QDQ form of the chunked kernels (cuda/quantize/mx_chunk.cuh): the magnitude rounded
    // on the grid in the unscaled domain, times the scale, to the output dtype, the sign kept
    constexpr FloatSpec f = kSpec;
    constexpr int kSignBit = DT == DType::f32 ? 31 : 15;
    const float scale = pow2f(e), inv = pow2f(-e);
    for (int j = 0; j < n; ++j) {
      const float xin = p.rule == ScaleRule::qutlass_absmax ? mul_rn(3.0f, v[j]) : v[j];
      const float rm = rne_mag<ET>(xin, inv);
      u32 sign = f2u(xin) >> 31;
      if (f.twos_complement) sign &= u32(rm != 0.0f);  // INT8 has no -0
      out[j] = out_mag_bits<DT>(mul_rn(rm, scale)) | (sign << kSignBit);
    }
  }
}

// The chunk's outputs: the producer's values v (dtype values as fp32, zeros past K) as dtype bits, or
// their QDQ.
template <DType DT, Qdq Q, ElemType ET>
__device__ __forceinline__ void finish_chunk(const float (&v)[kChunk], const FusedParams& p, u32 (&o)[kChunk]) {
  if constexpr (Q == Qdq::none) {
#pragma unroll
    for (int j = 0; j < kChunk; ++j) o[j] = round_to_dtype_bits(v[j], DT);  // exact: v holds dtype values
  } else if (p.g >= kChunk) {
    qdq_group<DT, Q, ET>(v, kChunk, p.g / kChunk, p, o);
  } else {
    for (int j0 = 0; j0 < kChunk; j0 += p.g) qdq_group<DT, Q, ET>(v + j0, p.g, 1, p, o + j0);
  }
}

// Chunk c of a row: op(a, b) elementwise (0 past K, and every value 0 for a lane past the row's
// chunks, which still joins its group's shuffles), finished (QDQ'd or rounded) and stored.
template <DType DT, Qdq Q, ElemType ET, class Op>
__device__ __forceinline__ void produce_chunk(const std::uint8_t* a, const std::uint8_t* b, std::uint8_t* y, i64 c,
                                              const FusedParams& p, Op op) {
  const bool in = c < p.cpr;
  float v[kChunk], w[kChunk];
  if (in) {
    load8<DT>(a, c * kChunk, p, v);
    load8<DT>(b, c * kChunk, p, w);
#pragma unroll
    for (int j = 0; j < kChunk; ++j) v[j] = c * kChunk + j < p.K ? op(v[j], w[j]) : 0.0f;
  } else {
#pragma unroll
    for (int j = 0; j < kChunk; ++j) v[j] = 0.0f;
  }
  u32 o[kChunk];
  finish_chunk<DT, Q, ET>(v, p, o);
  if (in) store8<DT>(y, c * kChunk, p, o);
}

template <DType DT, Qdq Q, ElemType ET>
__global__ void __launch_bounds__(kThreads) rms_norm_kernel(const FusedParams p) {
  const i64 row = blockIdx.x;
  const int t = threadIdx.x, lane = t % 32, warp = t / 32;
  const std::uint8_t* x = p.a + row * p.a_stride;
  std::uint8_t* y = p.y + row * p.y_stride;
  float v[kChunk];
  float acc = 0.0f;
  for (int i = 0; i < p.iters; ++i) {
    const i64 c = i64(i) * kThreads + t;
    if (c >= p.cpr) break;
    load8<DT>(x, c * kChunk, p, v);
#pragma unroll
    for (int j = 0; j < kChunk; ++j) acc = add_rn(acc, mul_rn(v[j], v[j]));
  }
#pragma unroll
  for (int st = 16; st >= 1; st >>= 1) acc = add_rn(acc, __shfl_xor_sync(kFull, acc, st));
  __shared__ float warp_sums[kThreads / 32];
  __shared__ float inv;
  if (lane == 0) warp_sums[warp] = acc;
  __syncthreads();
  if (warp == 0) {
    float s = lane < kThreads / 32 ? warp_sums[lane] : 0.0f;
#pragma unroll
    for (int st = kThreads / 64; st >= 1; st >>= 1) s = add_rn(s, __shfl_xor_sync(kFull, s, st));
    if (lane == 0) inv = rms_inverse(s, p.K, p.eps);
  }
  __syncthreads();
  const float r = inv;
  for (int i = 0; i < p.iters; ++i)  // uniform trip count: every lane joins the group shuffles
    produce_chunk<DT, Q, ET>(x, p.b, y, i64(i) * kThreads + t, p,
                             [r](float xv, float wv) { return rms_norm_element(xv, wv, r, DT); });
}

// One block per kThreads chunks of a row (segment), so that a single row spreads over the GPU.
template <DType DT, Qdq Q, ElemType ET>
__global__ void __launch_bounds__(kThreads) silu_mul_kernel(const FusedParams p) {
  const i64 row = blockIdx.x / p.iters, seg = blockIdx.x % p.iters;
  const int t = threadIdx.x;
  const std::uint8_t* gate = p.a + row * p.a_stride;
  const std::uint8_t* up = p.b + row * p.b_stride;
  std::uint8_t* y = p.y + row * p.y_stride;
  produce_chunk<DT, Q, ET>(gate, up, y, seg * kThreads + t, p,
                           [](float g, float u) { return silu_mul_element(g, u, DT); });
}

FusedParams make_params(const Tensor& a, const Tensor& b, const Tensor& y, const core::Problem* qdq) {
  FusedParams k;
  const i64 es = dtype_size(a.dtype);
  k.a = static_cast<const std::uint8_t*>(a.data);
  k.b = static_cast<const std::uint8_t*>(b.data);
  k.y = static_cast<std::uint8_t*>(y.data);
  k.a_stride = a.stride() * es;
  k.b_stride = b.rows == 1 ? 0 : b.stride() * es;
  k.y_stride = y.stride() * es;
  k.K = a.cols;
  k.cpr = (a.cols + kChunk - 1) / kChunk;
  k.iters = int((k.cpr + kThreads - 1) / kThreads);
  k.vec = a.cols % kChunk == 0 && aligned(k.a, k.a_stride, 16) && aligned(k.b, k.b_stride, 16) &&
          aligned(k.y, k.y_stride, 16);
  if (qdq) {
    k.g = qdq->g;
    k.rule = qdq->opt.rule;
    k.elem = qdq->elem;
    k.S = qdq->S;
  }
  return k;
}

template <template <DType, Qdq, ElemType> class Launch>
void launch(const char* fn, const Tensor& a, const Tensor& b, const Tensor& y, const core::Problem* qdq,
            float eps, void* stream) {
  FusedParams k = make_params(a, b, y, qdq);
  k.eps = eps;
  const cudaStream_t s = static_cast<cudaStream_t>(stream);
  dispatch_dtype(a.dtype, [&](auto dt) {
    constexpr DType DT = decltype(dt)::value;
    // the element type of none / NVFP4 is a placeholder (not read)
    if (!qdq) return Launch<DT, Qdq::none, ElemType::e2m1>::run(fn, k, a.rows, s);
    if (qdq->nvfp4()) return Launch<DT, Qdq::nvfp4, ElemType::e2m1>::run(fn, k, a.rows, s);
    dispatch_elem(qdq->info.elem, [&](auto et) { Launch<DT, Qdq::mx, decltype(et)::value>::run(fn, k, a.rows, s); });
  });
  check_launch(fn, "fused producer kernel");
}

unsigned grid_of(const char* fn, i64 blocks) {
  if (blocks > 0x7FFFFFFF)
    throw Error(Error::Code::unsupported, std::string("mxq::") + fn + ": the tensor needs more than 2^31 - 1 blocks");
  return unsigned(blocks);
}

template <DType DT, Qdq Q, ElemType ET>
struct RmsLaunch {  // one block per row
  static void run(const char* fn, const FusedParams& k, i64 rows, cudaStream_t s) {
    rms_norm_kernel<DT, Q, ET><<<grid_of(fn, rows), kThreads, 0, s>>>(k);
  }
};
template <DType DT, Qdq Q, ElemType ET>
struct SiluLaunch {  // one block per kThreads chunks of a row
  static void run(const char* fn, const FusedParams& k, i64 rows, cudaStream_t s) {
    silu_mul_kernel<DT, Q, ET><<<grid_of(fn, rows * k.iters), kThreads, 0, s>>>(k);
  }
};

}  // namespace

void rms_norm(const Tensor& x, const Tensor& weight, float eps, const Tensor& y, const core::Problem* qdq, void* stream) {
  launch<RmsLaunch>("rms_norm", x, weight, y, qdq, eps, stream);
}

void silu_mul(const Tensor& gate, const Tensor& up, const Tensor& y, const core::Problem* qdq, void* stream) {
  launch<SiluLaunch>("silu_mul", gate, up, y, qdq, 0.0f, stream);
}

}  // namespace mxq::cuda
