#pragma once
// The bit order of a packed W4A16 word (docs/linear.md): host and device.
//
// A lane's 32-bit word for one mma k-step holds 8 E2M1 codes as 4 pairs; pair i is the bf16x2 register
// a(2i), a(2i+1) of the m16n8k16 A fragment (i = 0: row g, columns c, c+1; 1: row g+8, c, c+1; 2: row g,
// c+2, c+3; 3: row g+8, c+2, c+3). The kernel makes pair i's two bf16 codes (sign to bit 15, the
// magnitude bits e1 e0 m to bits 8 7 6 of each half) with two operations for pairs 0-2 (rotate right
// by 4, 10, 14, then AND 0x81C081C0) and three for pair 3; this table says where each bit of each code
// sits in the word so that those operations give it. (Plain nibbles took four operations per pair.)
namespace mxq::core {

// kCodeBit[pair][half][b]: the word bit holding bit b of the code (b = 0: m, 1: e0, 2: e1, 3: sign);
// half 0 is the low bf16 (the pair's first column), 1 the high one.
constexpr int kCodeBit[4][2][4] = {
    {{10, 11, 12, 19}, {26, 27, 28, 3}},   // rotate right by 4
    {{16, 17, 18, 25}, {0, 1, 2, 9}},      // rotate right by 10
    {{20, 21, 22, 29}, {4, 5, 6, 13}},     // rotate right by 14
    {{14, 7, 8, 15}, {30, 23, 24, 31}},    // (w & 0x81808180) | ((w >> 8) & 0x00400040)
};
constexpr int kPairRotation[3] = {4, 10, 14};

constexpr unsigned pack_code_bits(unsigned word, int pair, int half, unsigned code) {
  for (int b = 0; b < 4; ++b) word |= ((code >> b) & 1u) << kCodeBit[pair][half][b];
  return word;
}
constexpr unsigned unpack_code_bits(unsigned word, int pair, int half) {
  unsigned code = 0;
  for (int b = 0; b < 4; ++b) code |= ((word >> kCodeBit[pair][half][b]) & 1u) << b;
  return code;
}

// The sm90a prefill kernel's x tiles (cuda/gemm/w4a16_wgmma.cuh): its wgmma k16 step i reads columns
// 16 i .. 16 i + 15 of a shared-memory tile as k = 0..15, while lane (g, q)'s packed word i holds the
// weights of columns 16 q + 4 i + 0..3 (pairs 0-1: columns + 0, 1 as k = 2 q, 2 q + 1; pairs 2-3:
// columns + 2, 3 as k = 2 q + 8, 2 q + 9). So the producer writes x column c = 16 q + 4 i + 2 h + b of a
// 64-column tile to position 16 i + 8 h + 2 q + b.
#if defined(__CUDACC__)
__host__ __device__
#endif
constexpr int wgmma_x_column(int c) {
  const int q = c >> 4, i = (c >> 2) & 3, h = (c >> 1) & 1, b = c & 1;
  return 16 * i + 8 * h + 2 * q + b;
}

}  // namespace mxq::core
