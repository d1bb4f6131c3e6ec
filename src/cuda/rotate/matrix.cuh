#pragma once
// The rotation by a runtime RS x RS matrix R on the GPU (docs/numerics.md, "Runtime RS x RS
// matrices"): each group g of RS elements of a row becomes y_j = RN32(sum_i double(g_i) * double(R_ij)),
// the sum in double in increasing i, then quantized, QDQ'd, or (dequantize, R^-1) rounded to the output
// dtype, as the CPU backends do, so the same bytes.
//
// The double sums run on the FP64 tensor cores: mma.sync m8n8k4 f64 computes each output as four fused
// multiply-adds in increasing k onto the accumulator, each rounded to nearest even (the products are
// exact: 24 x 24 bits), so chaining the RS/4 k-steps from an accumulator of +0 performs exactly the
// sequential double sum (sm_80 and later, as the rest of the backend). rotation_test's CudaRotationMatrix
// cases hold it to the CPU's bytes with sums whose value depends on the order (wide_matrix), and so
// does dev/probes/dmma_order.cu on random data, with the instruction's throughput.
//
// Work: a warp owns tiles of TG consecutive rotation groups in the chunk numbering of the by-rows plan
// (chunks of 8, a row padded to whole quantization blocks; the padding forms whole groups of zeros):
// it loads the tile as fp32 into shared memory (xs), multiplies into ys, then each lane takes its
// chunks (chunk i in lane i mod 32, as block_kernel) through the same chunk code as the other kernels.
#include "cuda/common/params.cuh"
#include "cuda/common/reductions.cuh"

#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ < 800
#error "the matrix rotation needs the f64 mma of sm_80 and later"
#endif

namespace mxq::cuda {

enum class MatrixOp : std::uint8_t { quantize, qdq, dequantize, amax };

// Threads per block of the matrix kernels: four warps keep RS = 256 within the shared memory of every
// sm_80+ device (99 KB on sm_86/89).
constexpr int kMatrixThreads = 128;
constexpr int kMatrixChunk = 8;  // elements per chunk (the by-rows plan)

// Rotation groups of a warp tile: the f64 mma's 8 rows, or 16 for RS = 16 (a tile is whole warps of chunks).
__host__ __device__ constexpr int matrix_tile_groups(int rs) { return rs >= 32 ? 8 : 16; }
// Row strides (floats) of xs and ys: xs rows four banks apart (the A operand reads 8 rows x 4 columns),
// ys rows eight apart (the accumulators are written as pairs).
__host__ __device__ constexpr int matrix_xs_ld(int rs) { return rs + 4; }
__host__ __device__ constexpr int matrix_ys_ld(int rs) { return rs + 8; }
__host__ __device__ constexpr int matrix_warp_floats(int rs) {
  return matrix_tile_groups(rs) * (matrix_xs_ld(rs) + matrix_ys_ld(rs));
}
constexpr int matrix_smem_bytes(int rs) { return matrix_warp_floats(rs) * int(sizeof(float)) * (kMatrixThreads / 32); }

// What the matrix kernels take besides the chunk parameters.
struct MatrixArgs {
  const void* R = nullptr;  // RS x RS, row-major, device memory
  bool r_bf16 = false;      // R as bf16 (else f32)
  DType dt = DType::f32;    // quantize, qdq, amax: the input's dtype; dequantize: the output's
  u32* acc = nullptr;       // amax: the accumulator (zeroed before)
  // The sums as fused multiply-adds on the CUDA cores instead of the f64 mma (the same values by the
  // definition; half the FP64 rate on the H100/H200): MXQ_CUDA_MATRIX_CUDA_CORES=1, a test switch that
  // holds the tensor-core path to the plain one (rotation_test runs both).
  bool cuda_cores = false;
  // MatrixPrecision::bf16 (quantize, qdq, amax): the bf16 tensor-core product of matrix_bf16.cuh.
  bool bf16 = false;
};

__device__ __forceinline__ double matrix_entry(const MatrixArgs& m, int idx) {
  if (m.r_bf16) return double(u2f(u32(__ldg(static_cast<const unsigned short*>(m.R) + idx)) << 16));
  return double(__ldg(static_cast<const float*>(m.R) + idx));
}

// d += a * b over one k-step of four: D(8x8) = A(8x4) B(4x8) + D, this lane's A element a = A[lane/4][lane%4],
// B element b = B[lane%4][lane/4], accumulators D[lane/4][2 (lane%4) + {0, 1}].
__device__ __forceinline__ void dmma_step(double (&d)[2], double a, double b) {
  asm volatile("mma.sync.aligned.m8n8k4.row.col.f64.f64.f64.f64 {%0, %1}, {%2}, {%3}, {%0, %1};\n"
               : "+d"(d[0]), "+d"(d[1])
               : "d"(a), "d"(b));
}

// ys[g][n0 + j] for the NB n-tiles of 8 columns from n0 of rows mt..mt+7 of the warp tile.
template <int NB>
__device__ __forceinline__ void matrix_columns(const MatrixArgs& m, int rs, const float* xs, float* ys, int mt, int n0) {
  const int lane = int(threadIdx.x & 31u), gr = lane >> 2, kq = lane & 3;
  double d[NB][2];
#pragma unroll
  for (int t = 0; t < NB; ++t) d[t][0] = d[t][1] = 0.0;  // +0: 0 + (-0) is +0, as the CPU's sum starts
  if (!m.cuda_cores) {
    const float* xrow = xs + (mt + gr) * matrix_xs_ld(rs) + kq;
#pragma unroll 4
    for (int s = 0; s < rs; s += 4) {
      const double a = double(xrow[s]);
      const int r0 = (s + kq) * rs + n0 + gr;
#pragma unroll
      for (int t = 0; t < NB; ++t) dmma_step(d[t], a, matrix_entry(m, r0 + 8 * t));
    }
  } else {
    // The same sums on the CUDA cores: this lane's outputs (row gr; columns 2 kq and 2 kq + 1 of each
    // n-tile), one fused multiply-add per product in increasing i.
    const float* xrow = xs + (mt + gr) * matrix_xs_ld(rs);
    for (int i = 0; i < rs; ++i) {
      const double a = double(xrow[i]);
      const int r0 = i * rs + n0 + 2 * kq;
#pragma unroll
      for (int t = 0; t < NB; ++t) {
        d[t][0] = fma(a, matrix_entry(m, r0 + 8 * t), d[t][0]);
        d[t][1] = fma(a, matrix_entry(m, r0 + 8 * t + 1), d[t][1]);
      }
    }
  }
  float* yrow = ys + (mt + gr) * matrix_ys_ld(rs) + n0 + 2 * kq;
#pragma unroll
  for (int t = 0; t < NB; ++t)
    *reinterpret_cast<float2*>(yrow + 8 * t) = make_float2(__double2float_rn(d[t][0]), __double2float_rn(d[t][1]));
}

// ys = xs @ R for the warp tile (every lane calls it; the caller syncs the warp before and after).
__device__ __forceinline__ void matrix_product(const MatrixArgs m, int rs, const float* xs, float* ys) {
  for (int mt = 0; mt < matrix_tile_groups(rs); mt += 8) {
    if (rs >= 32) {
      for (int n0 = 0; n0 < rs; n0 += 32) matrix_columns<4>(m, rs, xs, ys, mt, n0);
    } else {
      matrix_columns<2>(m, rs, xs, ys, mt, 0);
    }
  }
}

// Chunk c of the input as raw input words (the bf16 tensor-core path converts nothing); zeros past the
// end and in a row's padding.
template <DType DT>
__device__ __forceinline__ void matrix_load_words(const Params& p, const Coord& c, u32 (&w)[vec_words<DT, kMatrixChunk>()]) {
  if (c.active && c.k0 < p.K) {
    load_chunk_words<DT, kMatrixChunk>(p, c.row, c.k0, c.full, w);
  } else {
#pragma unroll
    for (int e = 0; e < vec_words<DT, kMatrixChunk>(); ++e) w[e] = 0;
  }
}
// The same chunk as fp32 bits (zero words are +0 in every dtype).
template <DType DT>
__device__ __forceinline__ void matrix_load(const Params& p, const Coord& c, u32 (&v)[kMatrixChunk]) {
  constexpr int W = vec_words<DT, kMatrixChunk>();
  u32 w[W];
  matrix_load_words<DT>(p, c, w);
  unpack_words<DT, kMatrixChunk, W>(w, v);
}
__device__ __forceinline__ void matrix_load(const Params& p, const MatrixArgs& m, const Coord& c, u32 (&v)[kMatrixChunk]) {
  if (m.dt == DType::bf16) matrix_load<DType::bf16>(p, c, v);
  else if (m.dt == DType::f16) matrix_load<DType::f16>(p, c, v);
  else matrix_load<DType::f32>(p, c, v);
}

__device__ __forceinline__ void matrix_put(float* row, const u32 (&v)[kMatrixChunk]) {
  reinterpret_cast<uint4*>(row)[0] = make_uint4(v[0], v[1], v[2], v[3]);
  reinterpret_cast<uint4*>(row)[1] = make_uint4(v[4], v[5], v[6], v[7]);
}
__device__ __forceinline__ void matrix_get(const float* row, u32 (&v)[kMatrixChunk]) {
  const uint4 a = reinterpret_cast<const uint4*>(row)[0], b = reinterpret_cast<const uint4*>(row)[1];
  v[0] = a.x, v[1] = a.y, v[2] = a.z, v[3] = a.w, v[4] = b.x, v[5] = b.y, v[6] = b.z, v[7] = b.w;
}

// The warp-tile loop: fill(c, v) gives chunk c's fp32 values, finish(c, y) consumes its rotated values.
// Every lane of a warp runs every tile (the product and the chunk code shuffle over the warp).
template <class Fill, class Finish>
__device__ __forceinline__ void matrix_tiles(const Params& p, const MatrixArgs& m, Fill&& fill, Finish&& finish) {
  extern __shared__ __align__(16) float matrix_smem[];
  const int rs = p.rot_size, log2rs = __ffs(rs) - 1;  // every size a power of two
  const int tg = matrix_tile_groups(rs);
  const int per_tile = tg * rs / kMatrixChunk;  // chunks of a tile: 32, 64, 128 or 256
  const int log2tile = __ffs(per_tile) - 1;
  const int warp = int(threadIdx.x >> 5), lane = int(threadIdx.x & 31u);
  float* xs = matrix_smem + warp * matrix_warp_floats(rs);
  float* ys = xs + tg * matrix_xs_ld(rs);
  const i64 tiles = (p.total + per_tile - 1) >> log2tile;  // (no 64-bit division: a call that spills)
  const i64 warps = i64(gridDim.x) * (kMatrixThreads / 32);
  for (i64 t = i64(blockIdx.x) * (kMatrixThreads / 32) + warp; t < tiles; t += warps) {
    const i64 i0 = t << log2tile;
    for (int q = lane; q < per_tile; q += 32) {
      const Coord c = coord<kMatrixChunk, false>(p, i0 + q);
      u32 v[kMatrixChunk];
      fill(c, v);
      const int e0 = q * kMatrixChunk;
      matrix_put(xs + (e0 >> log2rs) * matrix_xs_ld(rs) + (e0 & (rs - 1)), v);
    }
    __syncwarp();
    matrix_product(m, rs, xs, ys);
    __syncwarp();
    for (int q = lane; q < per_tile; q += 32) {
      const Coord c = coord<kMatrixChunk, false>(p, i0 + q);
      const int e0 = q * kMatrixChunk;
      u32 y[kMatrixChunk];
      matrix_get(ys + (e0 >> log2rs) * matrix_ys_ld(rs) + (e0 & (rs - 1)), y);
      finish(c, y);
    }
    __syncwarp();  // the next tile's loads overwrite xs and ys
  }
}

}  // namespace mxq::cuda
