#pragma once
// 16-bit outputs of FP4 codes by byte-permute table lookup (dequantize, and NVFP4 QDQ).
#include "cuda/common/config.cuh"

namespace mxq::cuda {

// prmt.b32 in its generic mode: a selector nibble with bit 3 set replicates the top bit of the chosen
// byte over the result byte (PTX ISA, prmt). Written out: __byte_perm documents only bits 2:0.
__device__ __forceinline__ u32 prmt_sign(u32 a, u32 b, u32 sel) {
  u32 r;
  asm("prmt.b32 %0, %1, %2, %3;" : "=r"(r) : "r"(a), "r"(b), "r"(sel));
  return r;
}

// 16-bit outputs of FP4 codes by table: t01..t67 hold the output bits of the eight magnitudes (two per
// word, entry 0 in the low half of t01); byte permutes split them into a high-byte and a low-byte
// table and look up four codes at a time, and a sign-replicating permute moves each code's sign bit
// (XORed with flip's) to bit 15 of its output. About 2.4 instructions per element.
template <int C>
__device__ __forceinline__ void fp4_bf16_lookup(const u32 (&cw)[C / 8], u32 t01, u32 t23, u32 t45, u32 t67, u32 flip,
                                                u32 (&o)[C / 2]) {
  const u32 th0 = __byte_perm(t01, t23, 0x7531), th1 = __byte_perm(t45, t67, 0x7531);  // high bytes
  const u32 tl0 = __byte_perm(t01, t23, 0x6420), tl1 = __byte_perm(t45, t67, 0x6420);  // low bytes
#pragma unroll
  for (int q = 0; q < C / 8; ++q) {
    const u32 w = cw[q] ^ flip, m = w & 0x77777777u, mh = m >> 16, ws = w << 4;
    const u32 ha = __byte_perm(th0, th1, m), la = __byte_perm(tl0, tl1, m);
    const u32 hb = __byte_perm(th0, th1, mh), lb = __byte_perm(tl0, tl1, mh);
    const u32 v[4] = {__byte_perm(la, ha, 0x5140), __byte_perm(la, ha, 0x7362), __byte_perm(lb, hb, 0x5140),
                      __byte_perm(lb, hb, 0x7362)};
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      // element 2j's sign (bit 8j+3 of w) is the top bit of byte j of w << 4, element 2j+1's (bit
      // 8j+7) that of byte j of w: replicated into bytes 1 and 3, kept at bits 15 and 31.
      const u32 sgn = prmt_sign(ws, w, ((0x8u | (4u + j)) << 12) | ((0x8u | u32(j)) << 4));
      o[4 * q + j] = v[j] | (sgn & 0x80008000u);
    }
  }
}

}  // namespace mxq::cuda
