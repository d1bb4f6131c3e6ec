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

}  // namespace mxq::core
