#pragma once
// The rotation by a runtime matrix with MatrixPrecision::bf16 (docs/numerics.md, "Runtime RS x RS
// matrices"): bf16 data and a bf16 R, so each product is exact in fp32; the tensor cores sum them
// (mma.sync m16n8k16, bf16 operands, fp32 accumulators) in their own order, within the stated bound of
// the exact sum, not the CPU's bytes. The rest is the exact mode's (matrix.cuh): a warp rotates a tile
// of rotation groups, then each lane takes its chunks through the other kernels' chunk code.
//
// Shared memory of a block: R once, in the B-fragment order of the mma (each lane's two registers of a
// k-step and n-tile as one 8-byte word: RS^2 * 2 bytes), then per warp a tile of 16 groups, first as
// bf16 (xs), then, in the same bytes, as the fp32 products (ys). RS <= 128 (the options' check): at
// RS = 128, 67,584 bytes per block of 4 warps, 102,400 per block of 8 (matrix_launch.cuh picks 8 at
// RS = 128 where two such blocks fit an SM).
#include "cuda/rotate/matrix.cuh"

namespace mxq::cuda {

template <int W>
constexpr bool kBf16Warps = W == 4 || W == 8;  // warps per block of the bf16 product's kernels

constexpr int kBf16TileGroups = 16;  // the mma's 16 rows
// Row stride of a warp tile, in bf16 elements for xs and in floats for ys: rows four banks apart for
// the A-fragment loads.
__host__ __device__ constexpr int bf16_tile_ld(int rs) { return rs + 8; }
__host__ __device__ constexpr int bf16_warp_floats(int rs) { return kBf16TileGroups * bf16_tile_ld(rs); }
constexpr int matrix_bf16_smem_bytes(int rs, int warps) {
  return rs * rs * 2 + bf16_warp_floats(rs) * int(sizeof(float)) * warps;
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
// block (of THREADS) calls it (it ends with the block's barrier).
template <int THREADS>
__device__ __forceinline__ void stage_bf16_matrix(const MatrixArgs& m, int rs, uint2* rf) {
  const unsigned short* r = static_cast<const unsigned short*>(m.R);
  const int nts = rs >> 3;
  for (int idx = int(threadIdx.x); idx < rs * rs / 4; idx += THREADS) {
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

// The warp-tile loop of one RS (matrix.cuh's matrix_tiles, with the bf16 product): each lane first
// issues the loads of all its chunks of a tile (RS / 16 of them, the view's own bf16 words; nothing
// consumes them before the last is issued, so they are in flight together), then writes them to the
// tile; finish(c, y) consumes chunk c's rotated values.
template <int RS, int WARPS, class Finish>
__device__ __forceinline__ void matrix_tiles_bf16_rs(const Params& p, const uint2* rf, float* smem_tiles, Finish&& finish) {
  constexpr int LD = bf16_tile_ld(RS), PER_TILE = kBf16TileGroups * RS / kMatrixChunk, PER_LANE = PER_TILE / 32;
  constexpr int LOG2TILE = PER_TILE == 32 ? 5 : PER_TILE == 64 ? 6 : PER_TILE == 128 ? 7 : 8;
  static_assert(PER_TILE == 1 << LOG2TILE && PER_LANE >= 1, "a tile is 32, 64, 128 or 256 chunks");
  constexpr int W = vec_words<DType::bf16, kMatrixChunk>();
  const int warp = int(threadIdx.x >> 5), lane = int(threadIdx.x & 31u);
  float* ys = smem_tiles + warp * bf16_warp_floats(RS);
  unsigned short* xs = reinterpret_cast<unsigned short*>(ys);
  const i64 tiles = (p.total + PER_TILE - 1) >> LOG2TILE;
  const i64 warps = i64(gridDim.x) * WARPS;
  for (i64 t = i64(blockIdx.x) * WARPS + warp; t < tiles; t += warps) {
    const i64 i0 = t << LOG2TILE;
    u32 w[PER_LANE][W];
#pragma unroll
    for (int j = 0; j < PER_LANE; ++j) {
      matrix_load_words<DType::bf16>(p, coord<kMatrixChunk, false>(p, i0 + lane + 32 * j), w[j]);
    }
#pragma unroll
    for (int j = 0; j < PER_LANE; ++j) {
      const int e0 = (lane + 32 * j) * kMatrixChunk;
      *reinterpret_cast<uint4*>(xs + (e0 / RS) * LD + (e0 % RS)) = make_uint4(w[j][0], w[j][1], w[j][2], w[j][3]);
    }
    __syncwarp();
    bf16_product<RS>(ys, rf);
    __syncwarp();
    // Not unrolled: the chunk code is large (runtime scale rule and rounding); eight copies of it
    // stalled the MXFP4 kernel on instruction fetch (ncu, H100: 7.9 of 13.9 cycles per instruction).
#pragma unroll 1
    for (int j = 0; j < PER_LANE; ++j) {
      const int q = lane + 32 * j;
      const Coord c = coord<kMatrixChunk, false>(p, i0 + q);
      const int e0 = q * kMatrixChunk;
      u32 y[kMatrixChunk];
      matrix_get(ys + (e0 / RS) * LD + (e0 % RS), y);
      finish(c, y);
    }
    __syncwarp();  // the next tile's stores overwrite xs
  }
}

// matrix_tiles (matrix.cuh) with the bf16 product, for bf16 x: finish(c, y) consumes chunk c's rotated
// values. Every thread of the block (WARPS warps) calls it.
template <int WARPS, class Finish>
__device__ __forceinline__ void matrix_tiles_bf16(const Params& p, const MatrixArgs& m, Finish&& finish) {
  static_assert(kBf16Warps<WARPS>, "blocks of 4 or 8 warps");
  extern __shared__ __align__(16) float matrix_smem[];
  const int rs = p.rot_size;
  uint2* rf = reinterpret_cast<uint2*>(matrix_smem);
  stage_bf16_matrix<WARPS * 32>(m, rs, rf);
  float* tiles = matrix_smem + rs * rs / 2;
  if (rs == 16) matrix_tiles_bf16_rs<16, WARPS>(p, rf, tiles, finish);
  else if (rs == 32) matrix_tiles_bf16_rs<32, WARPS>(p, rf, tiles, finish);
  else if (rs == 64) matrix_tiles_bf16_rs<64, WARPS>(p, rf, tiles, finish);
  else matrix_tiles_bf16_rs<128, WARPS>(p, rf, tiles, finish);
}

}  // namespace mxq::cuda
