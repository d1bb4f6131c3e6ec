// Scale layouts: linear [R, C] <-> the 128x4 swizzled layout of block-scaled GEMMs.
#include "cuda/backend.hpp"
#include "cuda/common/device.hpp"
#include "cuda/common/params.cuh"

namespace mxq::cuda {
namespace {

__global__ void swizzle_kernel(const std::uint8_t* lin, i64 lstride, i64 R, i64 Cl, std::uint8_t* sw, i64 Cp, i64 n) {
  const i64 o = i64(blockIdx.x) * kThreads + threadIdx.x;  // swizzled byte
  if (o >= n) return;
  const i64 tile = o >> 9, w = o & 511, tiles_per_row = Cp / 4;
  const i64 r = (tile / tiles_per_row) * 128 + ((w >> 2) & 3) * 32 + (w >> 4);
  const i64 col = (tile % tiles_per_row) * 4 + (w & 3);
  sw[o] = (r < R && col < Cl) ? lin[r * lstride + col] : std::uint8_t(0);
}

__global__ void unswizzle_kernel(const std::uint8_t* sw, i64 Cp, std::uint8_t* lin, i64 lstride, i64 R, i64 Cl) {
  const i64 o = i64(blockIdx.x) * kThreads + threadIdx.x;  // linear element
  if (o >= R * Cl) return;
  const i64 r = o / Cl, col = o % Cl;
  lin[r * lstride + col] = sw[swizzled_offset(r, col, Cp)];
}

}  // namespace

void swizzle_scales(const Tensor& linear, const Tensor& swizzled, void* stream) {
  const char* fn = "swizzle_scales";
  const i64 n = swizzled.rows * swizzled.cols;
  swizzle_kernel<<<unsigned(launch_blocks(fn, n)), kThreads, 0, static_cast<cudaStream_t>(stream)>>>(
      static_cast<const std::uint8_t*>(linear.data), linear.stride(), linear.rows, linear.cols,
      static_cast<std::uint8_t*>(swizzled.data), swizzled.cols, n);
  check_launch(fn, "swizzle_kernel");
}

void unswizzle_scales(const Tensor& swizzled, const Tensor& linear, void* stream) {
  const char* fn = "unswizzle_scales";
  const i64 n = linear.rows * linear.cols;
  unswizzle_kernel<<<unsigned(launch_blocks(fn, n)), kThreads, 0, static_cast<cudaStream_t>(stream)>>>(
      static_cast<const std::uint8_t*>(swizzled.data), swizzled.cols, static_cast<std::uint8_t*>(linear.data),
      linear.stride(), linear.rows, linear.cols);
  check_launch(fn, "unswizzle_kernel");
}

}  // namespace mxq::cuda
