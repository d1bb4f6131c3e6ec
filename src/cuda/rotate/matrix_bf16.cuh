#pragma once
// The rotation by a runtime matrix with MatrixPrecision::bf16 (docs/numerics.md, "Runtime RS x RS
// matrices"): bf16 data and a bf16 R, so each product is exact in fp32; the tensor cores sum them
// (mma.sync m16n8k16, bf16 operands, fp32 accumulators) in their own order, within the stated bound of
// the exact sum, not the CPU's bytes. The rest is the exact mode's (matrix.cuh): a warp rotates a tile
// of rotation groups, then each lane takes its chunks through the other kernels' chunk code.
//
// Shared memory of a block: R once, in the B-fragment order of the mma (each lane's two registers of a
// k-step and n-tile as one 8-byte word: RS^2 * 2 bytes), then per warp a tile of 16 groups, first as
// bf16 (xs), then, in the same bytes, as the fp32 products (ys). RS <= 128 (the options' check): 66 KB
// per block at RS = 128.
#include "cuda/rotate/matrix.cuh"

namespace mxq::cuda {

constexpr int kBf16TileGroups = 16;  // the mma's 16 rows
// Row stride of a warp tile, in bf16 elements for xs and in floats for ys: rows four banks apart for
// the A-fragment loads.
__host__ __device__ constexpr int bf16_tile_ld(int rs) { return rs + 8; }
__host__ __device__ constexpr int bf16_warp_floats(int rs) { return kBf16TileGroups * bf16_tile_ld(rs); }
constexpr int matrix_bf16_smem_bytes(int rs) {
  return rs * rs * 2 + bf16_warp_floats(rs) * int(sizeof(float)) * (kMatrixThreads / 32);
}

// d += A(16x16) B(16x8): a = this lane's A registers (rows gr, gr + 8; columns 2 kq + {0, 1}, + 8),
// b = its B registers (rows 2 kq + {0, 1}, + 8; column gr), d = rows gr, gr + 8, columns 2 kq + {0, 1}.
__device__ __forceinline__ void bf16_mma(float (&d)[4], u32 a0, u32 a1, u32 a2, u32 a3, uint2 b) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, {%0, %1, %2, %3};\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b.x), "r"(b.y));
}

// R (bf16, row-major, global) into rf in fragment order: rf[(ks * RS/8 + nt) * 32 + lane] holds
// R[16 ks + 2 kq + {0, 1}][8 nt + gr] and R[16 ks + 2 kq + 8 + {0, 1}][8 nt + gr]. Every thread of the
// block calls it (it ends with the block's barrier).
__device__ __forceinline__ void stage_bf16_matrix(const MatrixArgs& m, int rs, uint2* rf) {
  const unsigned short* r = static_cast<const unsigned short*>(m.R);
  const int nts = rs >> 3;
  for (int idx = int(threadIdx.x); idx < rs * rs / 4; idx += kMatrixThreads) {
    const int l = idx & 31, t = idx >> 5;
    const int ks = t / nts, nt = t - ks * nts;
    const int k0 = 16 * ks + 2 * (l & 3), n = 8 * nt + (l >> 2);
    const auto e = [&](int k) { return u32(__ldg(r + k * rs + n)); };
    rf[idx] = make_uint2(e(k0) | e(k0 + 1) << 16, e(k0 + 8) | e(k0 + 9) << 16);
  }
  __syncthreads();
}

// ys = xs @ R for the warp's tile (xs: bf16, ys: fp32 in the same bytes). Every lane calls it.
template <int RS>
__device__ __forceinline__ void bf16_product(float* ys, const uint2* rf) {
  constexpr int NT = RS / 8, KS = RS / 16, LD = bf16_tile_ld(RS);
  const unsigned short* xs = reinterpret_cast<const unsigned short*>(ys);
  const int lane = int(threadIdx.x & 31u), gr = lane >> 2, kq = lane & 3;
  float d[NT][4];
#pragma unroll
  for (int t = 0; t < NT; ++t) d[t][0] = d[t][1] = d[t][2] = d[t][3] = 0.0f;
#pragma unroll
  for (int ks = 0; ks < KS; ++ks) {
    const unsigned short* a = xs + gr * LD + 16 * ks + 2 * kq;
    const u32 a0 = *reinterpret_cast<const u32*>(a), a1 = *reinterpret_cast<const u32*>(a + 8 * LD);
    const u32 a2 = *reinterpret_cast<const u32*>(a + 8), a3 = *reinterpret_cast<const u32*>(a + 8 * LD + 8);
#pragma unroll
    for (int t = 0; t < NT; ++t) bf16_mma(d[t], a0, a1, a2, a3, rf[(ks * NT + t) * 32 + lane]);
  }
  __syncwarp();  // every lane has read xs before ys, the same bytes, is written
  float* y = ys + gr * LD + 2 * kq;
  // + 0.0f: a zero sum is +0, as the exact sum from +0 is (the tensor cores may give -0).
#pragma unroll
  for (int t = 0; t < NT; ++t) {
    *reinterpret_cast<float2*>(y + 8 * t) = make_float2(d[t][0] + 0.0f, d[t][1] + 0.0f);
    *reinterpret_cast<float2*>(y + 8 * LD + 8 * t) = make_float2(d[t][2] + 0.0f, d[t][3] + 0.0f);
  }
}

// matrix_tiles (matrix.cuh) with the bf16 product: fill(c, v) gives chunk c's values as fp32 bits of
// bf16 values, finish(c, y) consumes its rotated values. Every thread of the block calls it.
template <class Fill, class Finish>
__device__ __forceinline__ void matrix_tiles_bf16(const Params& p, const MatrixArgs& m, Fill&& fill, Finish&& finish) {
  extern __shared__ __align__(16) float matrix_smem[];
  const int rs = p.rot_size, log2rs = __ffs(rs) - 1;
  uint2* rf = reinterpret_cast<uint2*>(matrix_smem);
  stage_bf16_matrix(m, rs, rf);
  const int ld = bf16_tile_ld(rs);
  const int per_tile = kBf16TileGroups * rs / kMatrixChunk;  // 32, 64, 128 or 256 chunks
  const int log2tile = __ffs(per_tile) - 1;
  const int warp = int(threadIdx.x >> 5), lane = int(threadIdx.x & 31u);
  float* ys = matrix_smem + rs * rs / 2 + warp * bf16_warp_floats(rs);
  unsigned short* xs = reinterpret_cast<unsigned short*>(ys);
  const i64 tiles = (p.total + per_tile - 1) >> log2tile;
  const i64 warps = i64(gridDim.x) * (kMatrixThreads / 32);
  for (i64 t = i64(blockIdx.x) * (kMatrixThreads / 32) + warp; t < tiles; t += warps) {
    const i64 i0 = t << log2tile;
    for (int q = lane; q < per_tile; q += 32) {
      const Coord c = coord<kMatrixChunk, false>(p, i0 + q);
      u32 v[kMatrixChunk];
      fill(c, v);
      const int e0 = q * kMatrixChunk;
      *reinterpret_cast<uint4*>(xs + (e0 >> log2rs) * ld + (e0 & (rs - 1))) =
          make_uint4((v[0] >> 16) | (v[1] & 0xFFFF0000u), (v[2] >> 16) | (v[3] & 0xFFFF0000u),
                     (v[4] >> 16) | (v[5] & 0xFFFF0000u), (v[6] >> 16) | (v[7] & 0xFFFF0000u));
    }
    __syncwarp();
    if (rs == 16) bf16_product<16>(ys, rf);
    else if (rs == 32) bf16_product<32>(ys, rf);
    else if (rs == 64) bf16_product<64>(ys, rf);
    else bf16_product<128>(ys, rf);
    __syncwarp();
    for (int q = lane; q < per_tile; q += 32) {
      const Coord c = coord<kMatrixChunk, false>(p, i0 + q);
      const int e0 = q * kMatrixChunk;
      u32 y[kMatrixChunk];
      matrix_get(ys + (e0 >> log2rs) * ld + (e0 & (rs - 1)), y);
      finish(c, y);
    }
    __syncwarp();  // the next tile's loads overwrite xs
  }
}

}  // namespace mxq::cuda
