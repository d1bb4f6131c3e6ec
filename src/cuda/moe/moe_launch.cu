// Host side of the W4A16 MoE on CUDA (docs/moe.md): one launch per primitive, the whole block as five
// launches on the caller's stream over the caller's workspace (nothing allocated, nothing synchronised).
// The entry layer (src/moe.cpp) has validated every view.
#include <algorithm>
#include <cmath>

#include "core/validate.hpp"
#include "cuda/backend.hpp"
#include "cuda/common/device.hpp"
#include "cuda/moe/moe_kernels.cuh"

namespace mxq::cuda {
namespace {
namespace mk = moe_kernels;

constexpr int kElementwiseThreads = 256;

unsigned elementwise_blocks(const char* fn, std::int64_t cells) {
  const std::int64_t b = std::max<std::int64_t>(1, (cells + kElementwiseThreads - 1) / kElementwiseThreads);
  return static_cast<unsigned>(std::min<std::int64_t>(b, std::int64_t(sm_count(fn)) * 32));
}

int rs_code(DType d) { return d == DType::f32 ? 0 : d == DType::bf16 ? 1 : 2; }

// Tokens per work item: 8 where an expert gets few rows on average (decode), else 64.
int tile_tokens(std::int64_t P, std::int64_t E) { return P <= 8 * E ? 8 : 64; }

template <int TOKENS, bool NV, bool F16>
void launch_grouped(const mk::GemmArgs& a, std::int64_t P, std::int64_t E, cudaStream_t s, const char* fn) {
  auto kernel = mk::grouped_kernel<TOKENS, 4, NV, F16>;
  constexpr int smem = gemm::reduce_floats<TOKENS>() * 4;
  static const cudaError_t attr = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem);
  check(attr, fn, "cudaFuncSetAttribute(MaxDynamicSharedMemorySize)");
  // Work items: at most one partial tile per expert with rows, plus P / TOKENS full ones.
  const std::int64_t items = std::min(E, P) + P / TOKENS;
  if (items > 65535)
    core::fail(Error::Code::unsupported, fn, std::to_string(P) + " routed rows over " + std::to_string(E) + " experts: at most 65535 work items per launch");
  const dim3 grid(static_cast<unsigned>((a.N + 31) / 32), static_cast<unsigned>(std::max<std::int64_t>(items, 1)));
  kernel<<<grid, gemm::kWarps * 32, smem, s>>>(a);
  check_launch(fn, "grouped_kernel");
}

void grouped(const mk::GemmArgs& a, bool nv, bool f16, std::int64_t P, std::int64_t E, cudaStream_t s, const char* fn) {
  const int t = tile_tokens(P, E);
  const auto go = [&]<int T>() {
    if (nv)
      f16 ? launch_grouped<T, true, true>(a, P, E, s, fn) : launch_grouped<T, true, false>(a, P, E, s, fn);
    else
      f16 ? launch_grouped<T, false, true>(a, P, E, s, fn) : launch_grouped<T, false, false>(a, P, E, s, fn);
  };
  if (t == 8)
    go.template operator()<8>();
  else
    go.template operator()<64>();
}

}  // namespace

void moe_route(const Tensor& ids, std::int64_t E, const Tensor& offsets, const Tensor& sorted, const Tensor& pos, const Tensor& flag,
               void* stream) {
  const char* fn = "moe_route";
  if (E > mk::kMaxExperts)
    core::fail(Error::Code::unsupported, fn, "E " + std::to_string(E) + ": the CUDA routing takes at most " + std::to_string(mk::kMaxExperts) + " experts");
  const cudaStream_t s = static_cast<cudaStream_t>(stream);
  const int T = int(ids.rows), k = int(ids.cols);
  const int smem = int(E) * 4;
  // The attribute once per kernel, at the most any call uses: a per-call value could be lowered by another
  // host thread between its set and this launch.
  constexpr int kMaxSmem = mk::kMaxExperts * 4;
  auto* off = static_cast<int*>(offsets.data);
  auto* so = static_cast<int*>(sorted.data);
  auto* po = static_cast<int*>(pos.data);
  auto* fl = static_cast<int*>(flag.data);
  if (ids.dtype == DType::i32) {
    static const cudaError_t attr = cudaFuncSetAttribute(mk::route_kernel<std::int32_t>, cudaFuncAttributeMaxDynamicSharedMemorySize, kMaxSmem);
    check(attr, fn, "cudaFuncSetAttribute");
    mk::route_kernel<std::int32_t><<<1, mk::kRouteThreads, smem, s>>>(static_cast<const std::int32_t*>(ids.data), ids.stride(), T, k,
                                                                       int(E), off, so, po, fl);
  } else {
    static const cudaError_t attr = cudaFuncSetAttribute(mk::route_kernel<std::int64_t>, cudaFuncAttributeMaxDynamicSharedMemorySize, kMaxSmem);
    check(attr, fn, "cudaFuncSetAttribute");
    mk::route_kernel<std::int64_t><<<1, mk::kRouteThreads, smem, s>>>(static_cast<const std::int64_t*>(ids.data), ids.stride(), T, k,
                                                                       int(E), off, so, po, fl);
  }
  check_launch(fn, "route_kernel");
}

void moe_linear(const Tensor& x, bool token_rows, std::int64_t k, const PackedExperts& w, const Tensor* bias, const Tensor& offsets,
                const Tensor& sorted, const Tensor* row_scale, const Tensor& y, void* stream) {
  const char* fn = "moe_linear";
  const cudaStream_t s = static_cast<cudaStream_t>(stream);
  const std::int64_t P = sorted.cols;
  mk::GemmArgs a{};
  a.codes = static_cast<const std::uint8_t*>(w.codes.data);
  a.scales = static_cast<const std::uint8_t*>(w.scales.data);
  a.codes_stride = w.codes.stride();
  a.scales_stride = w.scales.stride();
  a.exp_shift = static_cast<const int*>(w.exp_shift.data);
  a.tensor_scale = static_cast<const float*>(w.tensor_scale.data);
  a.x = static_cast<const std::uint16_t*>(x.data);
  a.x_stride = x.stride();
  a.token_rows = token_rows;
  a.k = int(k);
  a.offsets = static_cast<const int*>(offsets.data);
  a.sorted = static_cast<const int*>(sorted.data);
  a.E = int(w.E);
  a.N = w.N;
  a.K = w.K;
  a.katoms = int((w.K + 63) / 64);
  a.bias = bias ? static_cast<const std::uint16_t*>(bias->data) : nullptr;
  a.bias_stride = bias ? bias->stride() : 0;
  a.row_scale = row_scale ? row_scale->data : nullptr;
  a.rs_dtype = row_scale ? rs_code(row_scale->dtype) : 0;
  a.rs_stride = row_scale ? row_scale->stride() : 0;
  a.y = y.data;
  a.y_stride = y.stride();
  if (P > 0) grouped(a, w.format == Format::nvfp4, x.dtype == DType::f16, P, w.E, s, fn);
  // The dropped pairs' rows (none unless an id was out of range): zeros.
  if (P > 0) {
    mk::zero_dropped_kernel<<<unsigned(sm_count(fn)) * 4, kElementwiseThreads, 0, s>>>(a.offsets, a.E, int(P), w.N, y.data, y.stride(),
                                                                                       row_scale ? 4 : 2);
    check_launch(fn, "zero_dropped_kernel");
  }
}

void moe_activation(const Tensor& h, MoeActivation kind, float alpha, float limit, const Tensor& out, void* stream) {
  const char* fn = "moe_activation";
  const cudaStream_t s = static_cast<cudaStream_t>(stream);
  const std::int64_t rows = out.rows, I = out.cols;
  if (rows * I == 0) return;
  const unsigned blocks = elementwise_blocks(fn, rows * I);
  const auto* hp = static_cast<const std::uint16_t*>(h.data);
  auto* ap = static_cast<std::uint16_t*>(out.data);
  const auto go = [&]<int KIND>() {
    if (h.dtype == DType::f16)
      mk::activation_kernel<KIND, DType::f16><<<blocks, kElementwiseThreads, 0, s>>>(hp, h.stride(), ap, out.stride(), rows, I, alpha, limit);
    else
      mk::activation_kernel<KIND, DType::bf16><<<blocks, kElementwiseThreads, 0, s>>>(hp, h.stride(), ap, out.stride(), rows, I, alpha, limit);
  };
  switch (kind) {
    case MoeActivation::none: go.template operator()<0>(); break;
    case MoeActivation::swiglu: go.template operator()<1>(); break;
    case MoeActivation::swiglu_oai: go.template operator()<2>(); break;
  }
  check_launch(fn, "activation_kernel");
}

void moe_combine(const Tensor& o, const Tensor& pos, std::int64_t k, const Tensor& y, void* stream) {
  const char* fn = "moe_combine";
  const cudaStream_t s = static_cast<cudaStream_t>(stream);
  const std::int64_t T = y.rows, H = y.cols;
  if (T * H == 0) return;
  const unsigned blocks = elementwise_blocks(fn, T * H);
  const auto* op = static_cast<const float*>(o.data);
  const auto* pp = static_cast<const int*>(pos.data);
  auto* yp = static_cast<std::uint16_t*>(y.data);
  if (y.dtype == DType::f16)
    mk::combine_kernel<DType::f16><<<blocks, kElementwiseThreads, 0, s>>>(op, o.stride(), pp, int(k), yp, y.stride(), T, H);
  else
    mk::combine_kernel<DType::bf16><<<blocks, kElementwiseThreads, 0, s>>>(op, o.stride(), pp, int(k), yp, y.stride(), T, H);
  check_launch(fn, "combine_kernel");
}

void moe(const Tensor& x, const PackedExperts& w13, const Tensor* b13, const PackedExperts& w2, const Tensor* b2, const Tensor& topk_ids,
         const Tensor& topk_weights, MoeActivation activation, float alpha, float limit, const Tensor& y, const Tensor& workspace,
         void* stream) {
  const std::int64_t T = x.rows, k = topk_ids.cols, P = T * k, E = w13.E, N13 = w13.N, I = w2.K, H = w2.N;
  const MoeWorkspace ws = moe_workspace(T, k, E, N13, I, H, activation);
  auto* base = static_cast<std::uint8_t*>(workspace.data);
  const Device dev = x.device;
  const auto view = [&](std::int64_t off, DType dt, std::int64_t rows, std::int64_t cols) {
    return Tensor::of(base + off, dt, rows, cols, 0, dev);
  };
  const Tensor offsets = view(ws.expert_offsets, DType::i32, 1, E + 1), sorted = view(ws.sorted_pairs, DType::i32, 1, P),
               pos = view(ws.pair_pos, DType::i32, 1, P), flag = view(ws.error_flag, DType::i32, 1, 1);
  const Tensor h = view(ws.h, x.dtype, P, N13);
  const Tensor a = activation == MoeActivation::none ? h : view(ws.a, x.dtype, P, I);
  const Tensor o = view(ws.o, DType::f32, P, H);
  moe_route(topk_ids, E, offsets, sorted, pos, flag, stream);
  moe_linear(x, true, k, w13, b13, offsets, sorted, nullptr, h, stream);
  if (activation != MoeActivation::none) moe_activation(h, activation, alpha, limit, a, stream);
  moe_linear(a, false, k, w2, b2, offsets, sorted, &topk_weights, o, stream);
  moe_combine(o, pos, k, y, stream);
}

}  // namespace mxq::cuda
