#pragma once
// The one dispatch of quantize and QDQ: format, dtype, chunk width and the structural choices (scale
// rule family, rounding) become template parameters of block_kernel here and nowhere else.
#include <cstdlib>

#include "core/dispatch.hpp"
#include "core/format_traits.hpp"
#include "cuda/common/launch.cuh"
#include "cuda/quantize/block_kernel.cuh"
#include "cuda/quantize/nvfp4_cluster.cuh"

namespace mxq::cuda {

// f(Choices<...>{}) for the problem's rule and rounding. Only the combinations a format accepts are
// compiled (mxq::rules_for: quest and qutlass_absmax are MXFP4's among the MX formats; NVFP4 has its
// recipe's rule and quest).
template <class Fmt, class F>
void dispatch_choices(const core::Problem& p, F&& f) {
  auto by_round = [&](auto sc) {
    constexpr ScaleChoice SC = decltype(sc)::value;
    if (p.stochastic) f(Choices<SC, RoundChoice::stochastic>{});
    else f(Choices<SC, RoundChoice::rne>{});
  };
  if constexpr (Fmt::nvfp4) {
    if (p.opt.rule == ScaleRule::quest) by_round(std::integral_constant<ScaleChoice, ScaleChoice::quest>{});
    else by_round(std::integral_constant<ScaleChoice, ScaleChoice::amax>{});
  } else {
    switch (scale_choice(p.opt.rule)) {
      case ScaleChoice::quest:
        if constexpr (Fmt::format == Format::mxfp4) return by_round(std::integral_constant<ScaleChoice, ScaleChoice::quest>{});
        break;  // refused by validation for other formats
      case ScaleChoice::absmax:
        if constexpr (Fmt::format == Format::mxfp4) return by_round(std::integral_constant<ScaleChoice, ScaleChoice::absmax>{});
        break;  // refused by validation for other formats
      default: return by_round(std::integral_constant<ScaleChoice, ScaleChoice::amax>{});
    }
  }
}

// Whether block_kernel reduces the NVFP4 tensor amax itself (one cooperative launch) rather than an
// amax kernel before it: a flat launch at the fast chunk width with a 16-byte aligned x.
inline bool fuses_amax(const core::Problem& p, const Plan& pl, DType dt, const void* x, i64 x_stride_bytes) {
  return p.amax_acc && pl.flat && pl.C == (dt == DType::f32 ? 8 : 16) && aligned(x, x_stride_bytes, 16);
}

// Blocks of the one-cluster NVFP4 launch (nvfp4_cluster_kernel) for `chunks` chunks, or 0 where it
// does not apply: the kernel is not sm_90 code (older devices, or a build without sm_90), the chunks
// exceed what one cluster holds in registers, or the device cannot schedule such a cluster. The
// cluster has a block per 256 chunks (one chunk per thread) where it can, at most 16 (or 8) blocks.
template <auto Kernel>
int cluster_blocks(const char* fn, i64 chunks) {
  if (chunks > ClusterConfig::kMaxChunks) return 0;
  static std::atomic<int> largest[64] = {};  // per device: 0 not yet asked, -1 none, else blocks
  int dev = 0;
  check(cudaGetDevice(&dev), fn, "cudaGetDevice");
  int n = largest[dev & 63].load(std::memory_order_relaxed);
  if (n == 0) {
    n = -1;
    cudaFuncAttributes fa{};
    check(cudaFuncGetAttributes(&fa, Kernel), fn, "cudaFuncGetAttributes of the NVFP4 cluster kernel");
    if (fa.binaryVersion >= 90 && fa.ptxVersion >= 90) {
      check(cudaFuncSetAttribute(Kernel, cudaFuncAttributeNonPortableClusterSizeAllowed, 1), fn,
            "allowing a 16-block cluster");
      for (int b : {ClusterConfig::kMaxBlocks, 8}) {
        cudaLaunchConfig_t cfg{};
        cfg.gridDim = dim3(unsigned(b));
        cfg.blockDim = dim3(kThreads);
        cudaLaunchAttribute a{};
        a.id = cudaLaunchAttributeClusterDimension;
        a.val.clusterDim.x = unsigned(b), a.val.clusterDim.y = 1, a.val.clusterDim.z = 1;
        cfg.attrs = &a;
        cfg.numAttrs = 1;
        int clusters = 0;
        if (cudaOccupancyMaxActiveClusters(&clusters, Kernel, &cfg) == cudaSuccess && clusters > 0) {
          n = b;
          break;
        }
        (void)cudaGetLastError();  // a refused size is an answer, not an error
      }
    }
    largest[dev & 63].store(n, std::memory_order_relaxed);
  }
  // MXQ_CUDA_CLUSTER_BLOCKS=N (a tuning experiment, not for production): at most N blocks; 0 disables.
  static const int knob = [] {
    const char* v = std::getenv("MXQ_CUDA_CLUSTER_BLOCKS");
    return v && *v ? std::atoi(v) : -1;
  }();
  if (knob >= 0) n = std::min(n, knob > 0 ? knob : -1);
  const i64 per_block = i64(kThreads) * ClusterConfig::kIters;
  const i64 need = (chunks + per_block - 1) / per_block;
  if (n < 0 || need > n) return 0;
  return int(std::clamp<i64>((chunks + kThreads - 1) / kThreads, need, n));
}

// Kernel<<<k.blocks, kThreads, 0, s>>>(k) with one launch attribute (cooperative, cluster shape).
template <auto Kernel>
void launch_with(const char* fn, const Params& k, cudaStream_t s, const cudaLaunchAttribute& attr, const char* what) {
  cudaLaunchConfig_t cfg{};
  cfg.gridDim = dim3(k.blocks);
  cfg.blockDim = dim3(kThreads);
  cfg.stream = s;
  cudaLaunchAttribute a = attr;
  cfg.attrs = &a;
  cfg.numAttrs = 1;
  check(cudaLaunchKernelEx(&cfg, Kernel, k), fn, what);
}

// MXQ_CUDA_BLOCKS_PER_SM=N (a tuning experiment, not for production): every block_kernel launch at
// most N blocks per SM instead of the measured defaults below.
inline int blocks_per_sm_override() {
  static const int n = [] {
    const char* v = std::getenv("MXQ_CUDA_BLOCKS_PER_SM");
    return v && *v ? std::atoi(v) : 0;
  }();
  return n;
}

// f(fmt, dtc, cc): the format type, the input dtype and the chunk width of problem p as compile-time
// values, with the vector flags of k.x and k.y set for that dtype and width (they depend on it).
template <class F>
void dispatch_block(const core::Problem& p, DType dt, const Plan& pl, Params& k, F&& f) {
  core::dispatch_format(p.opt.format, [&](auto fmt) {
    core::dispatch_dtype(dt, [&](auto dtc) {
      constexpr DType DT = decltype(dtc)::value;
      dispatch_chunk<DT>(pl.C, [&](auto cc) {
        constexpr int C = decltype(cc)::value;
        k.x_vec = aligned(k.x, k.x_stride, vec_align<DT, C>());
        if (k.y) k.y_vec = aligned(k.y, k.y_stride, vec_align<DT, C>());
        f(fmt, dtc, cc);
      });
    });
  });
}

// Launches block_kernel<QDQ> for problem p over dtype dt with the plan's chunk width on stream s. k
// holds the views; the vector flags of x and y are set here (they depend on the chunk width).
// With k.fused_amax (see fuses_amax) the kernel reduces the tensor amax itself.
// Blocks per SM: QDQ with RNE and the FP8 quantize at most 2 (wave_grid's NOTE), else the occupancy.
template <bool QDQ>
void launch_block_kernel(const char* fn, const core::Problem& p, DType dt, const Plan& pl, Params& k, cudaStream_t s) {
  dispatch_block(p, dt, pl, k, [&](auto fmt, auto dtc, auto cc) {
    using Fmt = decltype(fmt);
    constexpr DType DT = decltype(dtc)::value;
    constexpr int C = decltype(cc)::value;
    constexpr bool kFp8 = Fmt::elem == ElemType::e4m3 || Fmt::elem == ElemType::e5m2;
    const int cap = blocks_per_sm_override() > 0 ? blocks_per_sm_override() : QDQ ? (p.stochastic ? 0 : 2) : (kFp8 ? 2 : 0);
    auto launch = [&](auto ch) {
      constexpr auto kernel = block_kernel<Fmt, DT, C, QDQ, decltype(ch)>;
      k.blocks = wave_grid<kernel>(fn, k.total, cap);
      kernel<<<k.blocks, kThreads, 0, s>>>(k);
    };
    if constexpr (C == fast_chunk<DT>()) {
      if constexpr (Fmt::nvfp4) {
        if (k.fused_amax) {
          // Small tensors on sm_90: one cluster, one read, no accumulator to zero.
          bool done = false;
          dispatch_choices<Fmt>(p, [&](auto ch) {
            constexpr auto kernel = nvfp4_cluster_kernel<DT, C, QDQ, decltype(ch)>;
            const int nb = cluster_blocks<kernel>(fn, k.total);
            if (nb == 0) return;
            k.blocks = unsigned(nb);
            cudaLaunchAttribute attr{};
            attr.id = cudaLaunchAttributeClusterDimension;
            attr.val.clusterDim.x = k.blocks, attr.val.clusterDim.y = 1, attr.val.clusterDim.z = 1;
            launch_with<kernel>(fn, k, s, attr, "cluster launch of the NVFP4 kernel");
            done = true;
          });
          if (done) return;
          check(cudaMemsetAsync(p.amax_acc, 0, sizeof(u32), s), fn, "zeroing the amax accumulator");
          // One cooperative launch (its grid-wide barrier needs every block resident: wave_grid's
          // grid is at most the resident blocks).
          return dispatch_choices<Fmt>(p, [&](auto ch) {
            constexpr auto kernel = block_kernel<Fmt, DT, C, QDQ, decltype(ch), true>;
            k.blocks = wave_grid<kernel>(fn, k.total, cap);
            // NOTE: three quarters of the L2 for the lines the second pass reads first; the
            // rest of it takes the streaming reads and the outputs.
            k.l2_keep_iters = i64(l2_bytes(fn)) * 3 / 4 / (i64(k.blocks) * kThreads * vec_bytes<DT, C>());
            cudaLaunchAttribute attr{};
            attr.id = cudaLaunchAttributeCooperative;
            attr.val.cooperative = 1;
            launch_with<kernel>(fn, k, s, attr, "cooperative launch of the fused-amax kernel");
          });
        }
      }
      dispatch_choices<Fmt>(p, launch);
    } else {
      launch(Choices<ScaleChoice::runtime, RoundChoice::runtime>{});
    }
  });
  check_launch(fn, QDQ ? "qdq kernel" : "quantize kernel");
}

}  // namespace mxq::cuda
