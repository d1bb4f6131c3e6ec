#pragma once
// The W4A16 linear's prefill kernel for sm90a: register-A WGMMA (docs/linear.md).
//
// A CTA of three warpgroups. Warpgroup 0 produces: one thread loads the CTA's BM rows of x, 64 columns
// at a time, with the tensor copy engine into a ring of raw tiles (zeros past M and K), and the
// warpgroup rewrites each into a STAGES-deep ring of 128-byte-swizzled tiles with the columns in the
// packed weights' K order (docs/linear.md: a lane's word j holds columns 16 tq + 4 j + 0..3, which the
// k16 step j pairs with k = 2 tq, 2 tq + 1 and 2 tq + 8, 2 tq + 9). Warpgroups 1 and 2 consume, each
// warp streaming its STRIPS 16-row strips of packed weights PF tiles ahead, straight into registers (the
// decode kernel's tiles and upcast) or, with WSMEM, through a cp.async ring in shared memory, and
// issuing wgmma.m64nBMk16 with the upcast weights as the A operand from registers and the x tile as B
// from shared memory. The CTA covers 128 * STRIPS rows of W and BM tokens over the whole of K (each
// output one fp32 sum in K order) or, with KSPLIT > 1, over one of KSPLIT contiguous ranges of K, the
// cluster's partial sums added in rank order (below).
//
// Exactness is the decode kernel's (w4a16.cuh): the A fragments are code * scale * 2^-d exactly.
#include <cuda.h>
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>

#include "core/linear_layout.hpp"
#include "cuda/gemm/w4a16.cuh"

#if defined(__CUDA_ARCH__) && defined(__CUDA_ARCH_FEAT_SM90_ALL)
#define MXQ_WGMMA_DEVICE 1
#endif

namespace mxq::cuda::gemm {

namespace wg {

constexpr int kThreads = 384;  // 3 warpgroups
constexpr int kTileBytes = 128;  // one x row of a 64-column tile (bf16 / fp16)

#ifdef MXQ_WGMMA_DEVICE
__device__ __forceinline__ std::uint32_t smem_addr(const void* p) {
  return static_cast<std::uint32_t>(__cvta_generic_to_shared(p));
}
__device__ __forceinline__ void mbar_init(std::uint64_t* b, int count) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" ::"r"(smem_addr(b)), "r"(count) : "memory");
}
__device__ __forceinline__ void mbar_expect_tx(std::uint64_t* b, std::uint32_t bytes) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(smem_addr(b)), "r"(bytes) : "memory");
}
__device__ __forceinline__ void mbar_arrive(std::uint64_t* b) {
  asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];" ::"r"(smem_addr(b)) : "memory");
}
__device__ __forceinline__ void mbar_wait(std::uint64_t* b, std::uint32_t parity) {
  std::uint32_t done = 0;
  do {
    asm volatile("{\n.reg .pred p;\nmbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\nselp.u32 %0, 1, 0, p;\n}"
                 : "=r"(done)
                 : "r"(smem_addr(b)), "r"(parity)
                 : "memory");
  } while (!done);
}
// Rows [c1, c1 + box rows) and columns [c0, c0 + 64) of x into dst, completing on bar.
__device__ __forceinline__ void tma_load_2d(void* dst, const CUtensorMap* map, std::uint64_t* bar, int c0, int c1) {
  asm volatile(
      "cp.async.bulk.tensor.2d.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1, {%3, %4}], [%2];" ::"r"(
          smem_addr(dst)),
      "l"(reinterpret_cast<std::uint64_t>(map)), "r"(smem_addr(bar)), "r"(c0), "r"(c1)
      : "memory");
}
__device__ __forceinline__ void wgmma_fence() { asm volatile("wgmma.fence.sync.aligned;" ::: "memory"); }
__device__ __forceinline__ void wgmma_commit() { asm volatile("wgmma.commit_group.sync.aligned;" ::: "memory"); }
template <int N>
__device__ __forceinline__ void wgmma_wait() {
  asm volatile("wgmma.wait_group.sync.aligned %0;" ::"n"(N) : "memory");
}
// The shared-memory descriptor of a K-major operand in 128-byte swizzle atoms (8 rows of 128 bytes,
// 1024 bytes apart); the tile starts 1024-byte aligned.
__device__ __forceinline__ std::uint64_t smem_desc(const void* p) {
  std::uint64_t d = (smem_addr(p) & 0x3FFFF) >> 4;
  d |= std::uint64_t(1) << 16;            // leading byte offset (unused with this swizzle)
  d |= std::uint64_t(1024 >> 4) << 32;    // stride byte offset: the next 8 rows
  d |= std::uint64_t(1) << 62;            // 128-byte swizzle
  return d;
}

// d (fp32, m64 x nN) += a (registers: the warp's 16 rows x 16 columns, the mma.m16n8k16 A layout) x B
// (N rows of 16 columns at desc).
template <int N, bool F16>
__device__ __forceinline__ void wgmma_rs(float (&d)[N / 2], const std::uint32_t (&a)[4], std::uint64_t desc);
template <> __device__ __forceinline__ void wgmma_rs<32, false>(float (&d)[16], const std::uint32_t (&a)[4], std::uint64_t desc) {
  asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %21, 0;\nwgmma.mma_async.sync.aligned.m64n32k16.f32.bf16.bf16 {%0,%1,%2,%3,%4,%5,%6,%7,%8,%9,%10,%11,%12,%13,%14,%15}, {%16,%17,%18,%19}, %20, p, 1, 1, 0;\n}"
               : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15])
               : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc), "r"(1));
}
template <> __device__ __forceinline__ void wgmma_rs<32, true>(float (&d)[16], const std::uint32_t (&a)[4], std::uint64_t desc) {
  asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %21, 0;\nwgmma.mma_async.sync.aligned.m64n32k16.f32.f16.f16 {%0,%1,%2,%3,%4,%5,%6,%7,%8,%9,%10,%11,%12,%13,%14,%15}, {%16,%17,%18,%19}, %20, p, 1, 1, 0;\n}"
               : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15])
               : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc), "r"(1));
}
template <> __device__ __forceinline__ void wgmma_rs<64, false>(float (&d)[32], const std::uint32_t (&a)[4], std::uint64_t desc) {
  asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %37, 0;\nwgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16 {%0,%1,%2,%3,%4,%5,%6,%7,%8,%9,%10,%11,%12,%13,%14,%15,%16,%17,%18,%19,%20,%21,%22,%23,%24,%25,%26,%27,%28,%29,%30,%31}, {%32,%33,%34,%35}, %36, p, 1, 1, 0;\n}"
               : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31])
               : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc), "r"(1));
}
template <> __device__ __forceinline__ void wgmma_rs<64, true>(float (&d)[32], const std::uint32_t (&a)[4], std::uint64_t desc) {
  asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %37, 0;\nwgmma.mma_async.sync.aligned.m64n64k16.f32.f16.f16 {%0,%1,%2,%3,%4,%5,%6,%7,%8,%9,%10,%11,%12,%13,%14,%15,%16,%17,%18,%19,%20,%21,%22,%23,%24,%25,%26,%27,%28,%29,%30,%31}, {%32,%33,%34,%35}, %36, p, 1, 1, 0;\n}"
               : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31])
               : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc), "r"(1));
}
template <> __device__ __forceinline__ void wgmma_rs<128, false>(float (&d)[64], const std::uint32_t (&a)[4], std::uint64_t desc) {
  asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %69, 0;\nwgmma.mma_async.sync.aligned.m64n128k16.f32.bf16.bf16 {%0,%1,%2,%3,%4,%5,%6,%7,%8,%9,%10,%11,%12,%13,%14,%15,%16,%17,%18,%19,%20,%21,%22,%23,%24,%25,%26,%27,%28,%29,%30,%31,%32,%33,%34,%35,%36,%37,%38,%39,%40,%41,%42,%43,%44,%45,%46,%47,%48,%49,%50,%51,%52,%53,%54,%55,%56,%57,%58,%59,%60,%61,%62,%63}, {%64,%65,%66,%67}, %68, p, 1, 1, 0;\n}"
               : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]), "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]), "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]), "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]), "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63])
               : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc), "r"(1));
}
template <> __device__ __forceinline__ void wgmma_rs<128, true>(float (&d)[64], const std::uint32_t (&a)[4], std::uint64_t desc) {
  asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %69, 0;\nwgmma.mma_async.sync.aligned.m64n128k16.f32.f16.f16 {%0,%1,%2,%3,%4,%5,%6,%7,%8,%9,%10,%11,%12,%13,%14,%15,%16,%17,%18,%19,%20,%21,%22,%23,%24,%25,%26,%27,%28,%29,%30,%31,%32,%33,%34,%35,%36,%37,%38,%39,%40,%41,%42,%43,%44,%45,%46,%47,%48,%49,%50,%51,%52,%53,%54,%55,%56,%57,%58,%59,%60,%61,%62,%63}, {%64,%65,%66,%67}, %68, p, 1, 1, 0;\n}"
               : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]), "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]), "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]), "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]), "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63])
               : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc), "r"(1));
}
template <> __device__ __forceinline__ void wgmma_rs<256, false>(float (&d)[128], const std::uint32_t (&a)[4], std::uint64_t desc) {
  asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %133, 0;\nwgmma.mma_async.sync.aligned.m64n256k16.f32.bf16.bf16 {%0,%1,%2,%3,%4,%5,%6,%7,%8,%9,%10,%11,%12,%13,%14,%15,%16,%17,%18,%19,%20,%21,%22,%23,%24,%25,%26,%27,%28,%29,%30,%31,%32,%33,%34,%35,%36,%37,%38,%39,%40,%41,%42,%43,%44,%45,%46,%47,%48,%49,%50,%51,%52,%53,%54,%55,%56,%57,%58,%59,%60,%61,%62,%63,%64,%65,%66,%67,%68,%69,%70,%71,%72,%73,%74,%75,%76,%77,%78,%79,%80,%81,%82,%83,%84,%85,%86,%87,%88,%89,%90,%91,%92,%93,%94,%95,%96,%97,%98,%99,%100,%101,%102,%103,%104,%105,%106,%107,%108,%109,%110,%111,%112,%113,%114,%115,%116,%117,%118,%119,%120,%121,%122,%123,%124,%125,%126,%127}, {%128,%129,%130,%131}, %132, p, 1, 1, 0;\n}"
               : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]), "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]), "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]), "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]), "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63]), "+f"(d[64]), "+f"(d[65]), "+f"(d[66]), "+f"(d[67]), "+f"(d[68]), "+f"(d[69]), "+f"(d[70]), "+f"(d[71]), "+f"(d[72]), "+f"(d[73]), "+f"(d[74]), "+f"(d[75]), "+f"(d[76]), "+f"(d[77]), "+f"(d[78]), "+f"(d[79]), "+f"(d[80]), "+f"(d[81]), "+f"(d[82]), "+f"(d[83]), "+f"(d[84]), "+f"(d[85]), "+f"(d[86]), "+f"(d[87]), "+f"(d[88]), "+f"(d[89]), "+f"(d[90]), "+f"(d[91]), "+f"(d[92]), "+f"(d[93]), "+f"(d[94]), "+f"(d[95]), "+f"(d[96]), "+f"(d[97]), "+f"(d[98]), "+f"(d[99]), "+f"(d[100]), "+f"(d[101]), "+f"(d[102]), "+f"(d[103]), "+f"(d[104]), "+f"(d[105]), "+f"(d[106]), "+f"(d[107]), "+f"(d[108]), "+f"(d[109]), "+f"(d[110]), "+f"(d[111]), "+f"(d[112]), "+f"(d[113]), "+f"(d[114]), "+f"(d[115]), "+f"(d[116]), "+f"(d[117]), "+f"(d[118]), "+f"(d[119]), "+f"(d[120]), "+f"(d[121]), "+f"(d[122]), "+f"(d[123]), "+f"(d[124]), "+f"(d[125]), "+f"(d[126]), "+f"(d[127])
               : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc), "r"(1));
}
template <> __device__ __forceinline__ void wgmma_rs<256, true>(float (&d)[128], const std::uint32_t (&a)[4], std::uint64_t desc) {
  asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %133, 0;\nwgmma.mma_async.sync.aligned.m64n256k16.f32.f16.f16 {%0,%1,%2,%3,%4,%5,%6,%7,%8,%9,%10,%11,%12,%13,%14,%15,%16,%17,%18,%19,%20,%21,%22,%23,%24,%25,%26,%27,%28,%29,%30,%31,%32,%33,%34,%35,%36,%37,%38,%39,%40,%41,%42,%43,%44,%45,%46,%47,%48,%49,%50,%51,%52,%53,%54,%55,%56,%57,%58,%59,%60,%61,%62,%63,%64,%65,%66,%67,%68,%69,%70,%71,%72,%73,%74,%75,%76,%77,%78,%79,%80,%81,%82,%83,%84,%85,%86,%87,%88,%89,%90,%91,%92,%93,%94,%95,%96,%97,%98,%99,%100,%101,%102,%103,%104,%105,%106,%107,%108,%109,%110,%111,%112,%113,%114,%115,%116,%117,%118,%119,%120,%121,%122,%123,%124,%125,%126,%127}, {%128,%129,%130,%131}, %132, p, 1, 1, 0;\n}"
               : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]), "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]), "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]), "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]), "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63]), "+f"(d[64]), "+f"(d[65]), "+f"(d[66]), "+f"(d[67]), "+f"(d[68]), "+f"(d[69]), "+f"(d[70]), "+f"(d[71]), "+f"(d[72]), "+f"(d[73]), "+f"(d[74]), "+f"(d[75]), "+f"(d[76]), "+f"(d[77]), "+f"(d[78]), "+f"(d[79]), "+f"(d[80]), "+f"(d[81]), "+f"(d[82]), "+f"(d[83]), "+f"(d[84]), "+f"(d[85]), "+f"(d[86]), "+f"(d[87]), "+f"(d[88]), "+f"(d[89]), "+f"(d[90]), "+f"(d[91]), "+f"(d[92]), "+f"(d[93]), "+f"(d[94]), "+f"(d[95]), "+f"(d[96]), "+f"(d[97]), "+f"(d[98]), "+f"(d[99]), "+f"(d[100]), "+f"(d[101]), "+f"(d[102]), "+f"(d[103]), "+f"(d[104]), "+f"(d[105]), "+f"(d[106]), "+f"(d[107]), "+f"(d[108]), "+f"(d[109]), "+f"(d[110]), "+f"(d[111]), "+f"(d[112]), "+f"(d[113]), "+f"(d[114]), "+f"(d[115]), "+f"(d[116]), "+f"(d[117]), "+f"(d[118]), "+f"(d[119]), "+f"(d[120]), "+f"(d[121]), "+f"(d[122]), "+f"(d[123]), "+f"(d[124]), "+f"(d[125]), "+f"(d[126]), "+f"(d[127])
               : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc), "r"(1));
}
#endif  // MXQ_WGMMA_DEVICE

constexpr int kRaw = 3;  // raw x tiles in flight unless the kernel's RAW says otherwise
// Split K: the fp32 partial tile (BM tokens x 128 * STRIPS rows, rows padded by 4 floats so that the
// accumulator fragments' stores hit distinct banks) in shared memory for the cluster's reduction.
template <int BM, int STRIPS>
constexpr int partial_bytes() { return BM * (128 * STRIPS + 4) * 4; }
// The tiles' region: the x rings, or the partial tile where that is larger (it is written after the
// mainloop). The barriers and the multiplier table follow it.
template <int BM, int STRIPS, int KSPLIT>
constexpr int region_bytes(int stages, int raw = kRaw) {
  const int rings = (stages + raw) * BM * kTileBytes;
  return KSPLIT > 1 && partial_bytes<BM, STRIPS>() > rings ? partial_bytes<BM, STRIPS>() : rings;
}
// With the weights through shared memory: a ring of `pf` slots per consumer warp, each STRIPS tiles of
// 512 code bytes and up to 64 scale bytes.
template <int STRIPS>
constexpr int weight_slot_bytes() { return STRIPS * 576; }
template <int BM, int STRIPS, int KSPLIT>
constexpr int smem_bytes(int stages, int raw = kRaw, int wring_pf = 0) {
  return 1024 /* alignment */ + region_bytes<BM, STRIPS, KSPLIT>(stages, raw) + 2 * (stages + raw) * 8 + 256 * 4 +
         (wring_pf ? 16 + 8 * wring_pf * weight_slot_bytes<STRIPS>() : 0);
}

#ifdef MXQ_WGMMA_DEVICE
// 4 floats of CTA `rank`'s shared memory at the address that `local` has in this CTA.
__device__ __forceinline__ float4 load_rank_f32x4(const float* local, std::uint32_t rank) {
  std::uint32_t remote;
  asm volatile("mapa.shared::cluster.u32 %0, %1, %2;" : "=r"(remote) : "r"(smem_addr(local)), "r"(rank));
  float4 v;
  asm volatile("ld.shared::cluster.v4.f32 {%0,%1,%2,%3}, [%4];" : "=f"(v.x), "=f"(v.y), "=f"(v.z), "=f"(v.w) : "r"(remote) : "memory");
  return v;
}
#endif

}  // namespace wg

// BM: tokens per CTA (32, 64, 128, 256); STRIPS: 16-row strips of W per consumer warp (the CTA covers
// 128 * STRIPS rows); STAGES: x tiles in flight; PF: weight tiles each consumer warp holds ahead;
// SMEM_EPI: the outputs go through shared memory (the x tiles' space, free by then) and leave as 16-byte
// row segments instead of 2-byte stores from the accumulator fragments; KSPLIT: CTAs of a cluster
// (grid.x = tiles along N x KSPLIT) that split K into contiguous ranges. With KSPLIT > 1 each CTA leaves
// its fp32 partial tile in shared memory, and CTA r of the cluster sums rows r * BM / KSPLIT .. of the
// partial tiles over the ranks in rank order through distributed shared memory (deterministic, no
// atomics, no workspace) and writes them as 16-byte row segments. RAW: x tiles the tensor copies keep in
// flight; WAIT: k16 wgmma groups left in flight; WSMEM: the weights through shared memory (PF slots per
// consumer warp, wg::smem_bytes' wring_pf) instead of registers.
template <int BM, int STRIPS, int STAGES, int PF, bool NV, bool F16, bool SMEM_EPI = false, int KSPLIT = 1, int RAW = wg::kRaw, int WAIT = 1,
          bool WSMEM = false>
__global__ void __launch_bounds__(wg::kThreads, 1) w4a16_wgmma_kernel(const __grid_constant__ CUtensorMap xmap, const LinearArgs a) {
  static_assert(WAIT >= 1 && WAIT <= 4, "WAIT: k16 groups left in flight, 1 .. 4");
  static_assert(BM % 16 == 0, "BM: the producer rewrites 16 rows per step");
  static_assert(KSPLIT >= 1 && KSPLIT <= 8 && BM % KSPLIT == 0, "KSPLIT: 1 .. 8 (a portable cluster), dividing the token tile");
#ifdef MXQ_WGMMA_DEVICE
  extern __shared__ unsigned char smem_raw[];
  // An offset from smem_raw (not an integer round trip) keeps every access below in the shared state space
  // (LDS / STS with 32-bit addresses rather than generic loads and stores).
  unsigned char* smem = smem_raw + ((1024u - (wg::smem_addr(smem_raw) & 1023u)) & 1023u);
  constexpr int kStage = BM * wg::kTileBytes;
  unsigned char* xs = smem;                       // STAGES permuted, swizzled tiles (the wgmma's B)
  unsigned char* raw = smem + STAGES * kStage;    // RAW tiles as loaded
  std::uint64_t* full = reinterpret_cast<std::uint64_t*>(smem + wg::region_bytes<BM, STRIPS, KSPLIT>(STAGES, RAW));
  std::uint64_t* empty = full + STAGES;
  std::uint64_t* raw_full = empty + STAGES;
  std::uint32_t* lut = reinterpret_cast<std::uint32_t*>(raw_full + RAW);
  // The weight rings (WSMEM), 16-byte aligned (the barriers may leave lut 8 bytes off).
  unsigned char* wring = reinterpret_cast<unsigned char*>(lut + 256);
  wring += (16u - (wg::smem_addr(wring) & 15u)) & 15u;

  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31, g = lane >> 2, tq = lane & 3;
  if (tid < 256) lut[tid] = std::uint32_t(scale_multiplier<NV, F16>(tid, a.exp_shift)) * 0x10001u;
  if (tid == 0) {
    for (int s = 0; s < STAGES; ++s) {
      wg::mbar_init(&full[s], 1);
      wg::mbar_init(&empty[s], 8);  // one arrival per consumer warp
    }
    for (int r = 0; r < RAW; ++r) wg::mbar_init(&raw_full[r], 1);
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
  }
  __syncthreads();
  // This CTA's range of K: atoms k_begin .. k_begin + katoms - 1 of the whole K's a.katoms.
  const int rank = KSPLIT > 1 ? int(ptx::cluster_rank()) : 0;
  const int k_begin = int(std::int64_t(rank) * a.katoms / KSPLIT);
  const int katoms = int(std::int64_t(rank + 1) * a.katoms / KSPLIT) - k_begin;
  const int ntile = int(blockIdx.x) / KSPLIT;
  const int m0 = int(blockIdx.y) * BM;

  if (warp < 4) {
    // Producer.
    asm volatile("setmaxnreg.dec.sync.aligned.u32 56;");
    if (tid == 0) {
      asm volatile("prefetch.tensormap [%0];" ::"l"(reinterpret_cast<std::uint64_t>(&xmap)) : "memory");
      asm volatile("griddepcontrol.wait;" ::: "memory");  // x may be the previous kernel's output
      for (int kt = 0; kt < RAW - 1 && kt < katoms; ++kt) {
        wg::mbar_expect_tx(&raw_full[kt], kStage);
        wg::tma_load_2d(raw + kt * kStage, &xmap, &raw_full[kt], (k_begin + kt) * 64, m0);
      }
    }
    const int x_row = (tid >> 3) * wg::kTileBytes, x_src = x_row + (tid & 7) * 16;
    int x_off[4];
#pragma unroll
    for (int u = 0; u < 4; ++u) {
      const int p = core::wgmma_x_column(8 * (tid & 7) + 2 * u);
      x_off[u] = 16 * ((p >> 3) ^ ((tid >> 3) & 7)) + 2 * (p & 7);
    }
    for (int kt = 0; kt < katoms; ++kt) {
      // Raw tile kt + RAW - 1 into the slot that tile kt - 1 left (every producer thread passed the
      // barrier below after reading it).
      if (tid == 0 && kt + RAW - 1 < katoms) {
        const int r = (kt + RAW - 1) % RAW;
        wg::mbar_expect_tx(&raw_full[r], kStage);
        wg::tma_load_2d(raw + r * kStage, &xmap, &raw_full[r], (k_begin + kt + RAW - 1) * 64, m0);
      }
      const int r = kt % RAW, st = kt % STAGES;
      wg::mbar_wait(&raw_full[r], (kt / RAW) & 1);
      wg::mbar_wait(&empty[st], ((kt / STAGES) & 1) ^ 1);
      // 16 raw bytes (row, columns 8 q .. 8 q + 7) are four 2-column units; unit u goes to column
      // wgmma_x_column(8 q + 2 u) of the row (core/linear_layout.hpp), in 16-byte chunk (that / 8)
      // swizzled by row % 8. Thread tid takes q = tid % 8 of rows tid / 8 + 16 it, so q and row % 8, and
      // with them the four destination offsets, are the same at every step: one 16-byte load and four
      // 4-byte stores per step at fixed offsets from the stage.
      const unsigned char* src = raw + r * kStage + x_src;
      unsigned char* dst = xs + st * kStage + x_row;
#pragma unroll
      for (int it = 0; it < BM / 16; ++it) {
        const uint4 v = *reinterpret_cast<const uint4*>(src + it * 16 * wg::kTileBytes);
        unsigned char* drow = dst + it * 16 * wg::kTileBytes;
        *reinterpret_cast<std::uint32_t*>(drow + x_off[0]) = v.x;
        *reinterpret_cast<std::uint32_t*>(drow + x_off[1]) = v.y;
        *reinterpret_cast<std::uint32_t*>(drow + x_off[2]) = v.z;
        *reinterpret_cast<std::uint32_t*>(drow + x_off[3]) = v.w;
      }
      asm volatile("fence.proxy.async.shared::cta;" ::: "memory");  // the tensor cores read it next
      asm volatile("bar.sync 1, 128;" ::: "memory");
      if (tid == 0) wg::mbar_arrive(&full[st]);
    }
    if constexpr (KSPLIT > 1) {  // the consumers' two cluster barriers (partial tiles written; read)
      ptx::cluster_sync();
      ptx::cluster_sync();
    }
  } else {
    asm volatile("setmaxnreg.inc.sync.aligned.u32 224;");
    const int cwg = (warp >> 2) - 1, w = warp & 3;  // consumer warpgroup, warp within it
    const std::int64_t nstrips = (a.N + 31) / 32 * 2;
    const std::int64_t strip_base = std::int64_t(ntile) * (8 * STRIPS) + cwg * (4 * STRIPS) + w;
    const int slot = NV ? lane : 2 * g + (tq >> 1);
    constexpr int kScaleStride = scale_bytes<NV>() / 2;  // u16 per tile
    // A strip past the weight's last one reads strip 0's tiles (its outputs are never written), so that
    // every load is unconditional.
    const uint4* cp[STRIPS];
    const std::uint16_t* sp[STRIPS];
    const unsigned char* sb[STRIPS];  // the strip's first tile's scale bytes
#pragma unroll
    for (int s = 0; s < STRIPS; ++s) {
      const std::int64_t strip = strip_base + 4 * s;
      const std::int64_t tile = (strip < nstrips ? strip : 0) * a.katoms + k_begin;
      cp[s] = a.codes + tile * 32 + lane;
      sb[s] = a.scales + tile * scale_bytes<NV>();
      sp[s] = reinterpret_cast<const std::uint16_t*>(sb[s]) + slot;
    }
    // WSMEM: each warp's tiles go through a PF-slot ring in shared memory by cp.async (16 bytes per lane, the
    // scales by the first 2 or 4 lanes), tile kt in slot kt % PF, one commit group per tile. Its waits count
    // groups (cp.async.wait_group), so a tile waits for its own copies only; register loads share one
    // scoreboard, and the first use of a tile's words also waited for the PF - 1 tiles loaded after it.
    constexpr int kWSlot = wg::weight_slot_bytes<STRIPS>();
    unsigned char* wmine = wring + (cwg * 4 + w) * PF * kWSlot;
    const auto issue = [&](int kt) {
      if (kt < katoms) {
        unsigned char* sl = wmine + (kt % PF) * kWSlot;
#pragma unroll
        for (int s = 0; s < STRIPS; ++s) {
          asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" ::"r"(wg::smem_addr(sl + s * 576 + lane * 16)),
                       "l"(cp[s] + std::int64_t(kt) * 32)
                       : "memory");
          if (lane < scale_bytes<NV>() / 16)
            asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" ::"r"(wg::smem_addr(sl + s * 576 + 512 + lane * 16)),
                         "l"(sb[s] + std::int64_t(kt) * scale_bytes<NV>() + lane * 16)
                         : "memory");
        }
      }
      asm volatile("cp.async.commit_group;" ::: "memory");
    };
    // The weight ring: tile kt in slot kt % PF. A slot is refilled right after its last read (the upcast of
    // its last k16 step), so that the load writes the slot's registers directly: with the copy-then-load
    // order the compiler loaded into temporaries and moved them into the slot within the same tile, which
    // waited for every load at once.
    uint4 wq[WSMEM ? 1 : PF][STRIPS];
    std::uint32_t sq[WSMEM ? 1 : PF][STRIPS];
    const auto load = [&](int d, int kt) {
#pragma unroll
      for (int s = 0; s < STRIPS; ++s) {
        wq[d][s] = load_stream(cp[s] + std::int64_t(kt) * 32);
        sq[d][s] = load_stream_u16(sp[s] + std::int64_t(kt) * kScaleStride);
      }
    };
    if constexpr (WSMEM) {
      for (int d = 0; d < PF - 1; ++d) issue(d);
    } else {
#pragma unroll
      for (int d = 0; d < PF; ++d)
        if (d < katoms) load(d, d);
    }

    float acc[STRIPS][BM / 2];
#pragma unroll
    for (int s = 0; s < STRIPS; ++s)
#pragma unroll
      for (int i = 0; i < BM / 2; ++i) acc[s][i] = 0.0f;

    for (int kt0 = 0; kt0 < katoms; kt0 += PF) {
#pragma unroll
      for (int d = 0; d < PF; ++d) {
        const int kt = kt0 + d;
        if (kt < katoms) {
          const int dd = WSMEM ? 0 : d;  // the register ring's slot (a constant once unrolled)
          std::uint32_t cm[STRIPS][2];
          if constexpr (WSMEM) {
            // Slot (kt - 1) % PF was read (into registers) by every lane in the previous tile.
            __syncwarp();
            issue(kt + PF - 1);
            asm volatile("cp.async.wait_group %0;" ::"n"(PF - 1) : "memory");
            __syncwarp();  // every lane's copies of tile kt have landed
            const unsigned char* sl = wmine + d * kWSlot;  // kt % PF == d
#pragma unroll
            for (int s = 0; s < STRIPS; ++s) {
              wq[0][s] = *reinterpret_cast<const uint4*>(sl + s * 576 + lane * 16);
              sq[0][s] = *reinterpret_cast<const std::uint16_t*>(sl + s * 576 + 512 + 2 * slot);
            }
          }
#pragma unroll
          for (int s = 0; s < STRIPS; ++s) {
            cm[s][0] = lut[sq[dd][s] & 0xFF];
            cm[s][1] = lut[sq[dd][s] >> 8];
          }
          const int st = kt % STAGES;
          wg::mbar_wait(&full[st], (kt / STAGES) & 1);
          const std::uint64_t desc = wg::smem_desc(xs + st * kStage);
#pragma unroll
          for (int i = 0; i < 4; ++i) {
            std::uint32_t frag[STRIPS][4];
#pragma unroll
            for (int s = 0; s < STRIPS; ++s) {
              const std::uint32_t word = i == 0 ? wq[dd][s].x : i == 1 ? wq[dd][s].y : i == 2 ? wq[dd][s].z : wq[dd][s].w;
              frag[s][0] = mul2<F16>(upcast_pair<F16, 0>(word), cm[s][0]);
              frag[s][1] = mul2<F16>(upcast_pair<F16, 1>(word), cm[s][1]);
              frag[s][2] = mul2<F16>(upcast_pair<F16, 2>(word), cm[s][0]);
              frag[s][3] = mul2<F16>(upcast_pair<F16, 3>(word), cm[s][1]);
            }
            if constexpr (!WSMEM)
              if (i == 3 && kt + PF < katoms) load(d, kt + PF);
            wg::wgmma_fence();
#pragma unroll
            for (int s = 0; s < STRIPS; ++s) wg::wgmma_rs<BM, F16>(acc[s], frag[s], desc + 2 * i);  // + 32 bytes per k16
            wg::wgmma_commit();
            wg::wgmma_wait<WAIT>();
            // The previous tile's last group is done: its x stage goes back to the producer.
            if (i == WAIT - 1 && kt > 0 && lane == 0) wg::mbar_arrive(&empty[(kt - 1) % STAGES]);
          }
        }
      }
    }
    wg::wgmma_wait<0>();
    if constexpr (WSMEM) asm volatile("cp.async.wait_all;" ::: "memory");  // the empty groups past K
    asm volatile("griddepcontrol.launch_dependents;");

    // Epilogue: acc[s][4j + e] is W row 16 * strip + g + 8 (e >> 1), token m0 + 8 j + 2 tq + (e & 1).
    const auto value = [&](float v, std::int64_t n) {
      float o = __fdiv_rn(__fmul_rn(v, a.mul), a.div);
      if (a.bias) {
        const std::uint16_t bb = a.bias[n];
        o = __fadd_rn(o, F16 ? __half2float(__ushort_as_half(bb)) : __bfloat162float(__ushort_as_bfloat16(bb)));
      }
      return F16 ? __half_as_ushort(__float2half_rn(o)) : __bfloat16_as_ushort(__float2bfloat16_rn(o));
    };
    // Outputs n .. n + 7 of token m (element i in bits 16 (i % 2) of word i / 2): one 16-byte store where
    // y's rows allow it and all 8 lie below N, else the ones below N one by one.
    const bool vec = (a.y_stride * 2) % 16 == 0 && reinterpret_cast<std::uintptr_t>(a.y) % 16 == 0;
    const auto store8 = [&](std::int64_t m, std::int64_t n, const uint4 v) {
      std::uint16_t* dst = a.y + m * a.y_stride + n;
      if (vec && n + 8 <= a.N) {
        *reinterpret_cast<uint4*>(dst) = v;
      } else {
        const std::uint32_t w[4] = {v.x, v.y, v.z, v.w};
        for (int i = 0; i < 8 && n + i < a.N; ++i) dst[i] = std::uint16_t(w[i / 2] >> (16 * (i % 2)));
      }
    };
    if constexpr (KSPLIT > 1) {
      constexpr int W = 128 * STRIPS, RF = W + 4;  // the tile's rows of W; a token's floats, padded
      static_assert(wg::partial_bytes<BM, STRIPS>() <= wg::region_bytes<BM, STRIPS, KSPLIT>(STAGES, RAW), "the partial tile fits");
      float* part = reinterpret_cast<float*>(smem);
      const std::int64_t n0 = std::int64_t(ntile) * W;
      const int ctid = tid - 128;
      asm volatile("bar.sync 2, 256;" ::: "memory");  // both consumer warpgroups are done with the x tiles
#pragma unroll
      for (int s = 0; s < STRIPS; ++s) {
        const int lb = (cwg * 4 * STRIPS + 4 * s + w) * 16 + g;
#pragma unroll
        for (int j = 0; j < BM / 8; ++j)
#pragma unroll
          for (int e = 0; e < 4; ++e) part[(8 * j + 2 * tq + (e & 1)) * RF + lb + (e >= 2 ? 8 : 0)] = acc[s][4 * j + e];
      }
      ptx::cluster_sync();  // every rank's partial tile is written
      constexpr int kRows = BM / KSPLIT;
      for (int c = ctid; c < kRows * (W / 8); c += 256) {
        const int lm = rank * kRows + c / (W / 8), ch = c % (W / 8);
        const std::int64_t m = m0 + lm, n = n0 + 8 * ch;
        if (m >= a.M || n >= a.N) continue;
        const float* src = part + lm * RF + 8 * ch;
        float v[8];
#pragma unroll
        for (int r = 0; r < KSPLIT; ++r) {
          const float4 lo = wg::load_rank_f32x4(src, r), hi = wg::load_rank_f32x4(src + 4, r);
          const float t[8] = {lo.x, lo.y, lo.z, lo.w, hi.x, hi.y, hi.z, hi.w};
#pragma unroll
          for (int i = 0; i < 8; ++i) v[i] = r == 0 ? t[i] : __fadd_rn(v[i], t[i]);
        }
        std::uint16_t o[8];
#pragma unroll
        for (int i = 0; i < 8; ++i) o[i] = n + i < a.N ? value(v[i], n + i) : std::uint16_t(0);
        store8(m, n, make_uint4(o[0] | std::uint32_t(o[1]) << 16, o[2] | std::uint32_t(o[3]) << 16, o[4] | std::uint32_t(o[5]) << 16,
                                o[6] | std::uint32_t(o[7]) << 16));
      }
      ptx::cluster_sync();  // no CTA leaves while another reads its partial tile
    } else if constexpr (SMEM_EPI) {
      constexpr int W = 128 * STRIPS, RB = 2 * W + 16;  // the tile's rows of W; a token's bytes, padded
      static_assert(BM * RB <= (STAGES + RAW) * kStage, "the output tile fits in the x tiles' space");
      const std::int64_t n0 = std::int64_t(ntile) * W;
      const int ctid = tid - 128;
      asm volatile("bar.sync 2, 256;" ::: "memory");  // both consumer warpgroups are done with the x tiles
#pragma unroll
      for (int s = 0; s < STRIPS; ++s) {
        const int lb = (cwg * 4 * STRIPS + 4 * s + w) * 16 + g;
#pragma unroll
        for (int j = 0; j < BM / 8; ++j)
#pragma unroll
          for (int e = 0; e < 4; ++e) {
            const int ln = lb + (e >= 2 ? 8 : 0), lm = 8 * j + 2 * tq + (e & 1);
            const std::int64_t n = n0 + ln;
            *reinterpret_cast<std::uint16_t*>(smem + lm * RB + 2 * ln) = n < a.N ? value(acc[s][4 * j + e], n) : std::uint16_t(0);
          }
      }
      asm volatile("bar.sync 2, 256;" ::: "memory");
      for (int c = ctid; c < BM * (W / 8); c += 256) {
        const int lm = c / (W / 8), ch = c % (W / 8);
        const std::int64_t m = m0 + lm, n = n0 + 8 * ch;
        if (m >= a.M || n >= a.N) continue;
        store8(m, n, *reinterpret_cast<const uint4*>(smem + lm * RB + 16 * ch));
      }
    } else {
#pragma unroll
      for (int s = 0; s < STRIPS; ++s) {
        const std::int64_t nb = (strip_base + 4 * s) * 16 + g;
#pragma unroll
        for (int j = 0; j < BM / 8; ++j)
#pragma unroll
          for (int e = 0; e < 4; ++e) {
            const std::int64_t n = nb + (e >= 2 ? 8 : 0);
            const std::int64_t m = m0 + 8 * j + 2 * tq + (e & 1);
            if (n < a.N && m < a.M) a.y[m * a.y_stride + n] = value(acc[s][4 * j + e], n);
          }
      }
    }
  }
#endif
}

}  // namespace mxq::cuda::gemm
