// A consumer of an installed mxq: quantizes a small tensor and checks one known code.
#include <cstdio>
#include <vector>

#include <mxq/mxq.hpp>

int main() {
  std::vector<float> x(64);
  for (int i = 0; i < 64; ++i) x[i] = 0.25f * float(i - 32);  // block 0 amax 8, block 1 amax 7.75
  std::vector<std::uint8_t> codes(32), scales(2);
  mxq::QuantizedOut out;
  out.codes = mxq::Tensor::of(codes.data(), mxq::DType::u8, 1, 32);
  out.scales = mxq::Tensor::of(scales.data(), mxq::DType::u8, 1, 2);
  mxq::quantize(mxq::Tensor::of(x.data(), mxq::DType::f32, 1, 64), out,
                mxq::QuantOptions::mx(mxq::Format::mxfp4, mxq::ScaleRule::floor));
  // floor rule: block 0 amax 8 -> e = 3 - 2 = 1, scale byte 128; x[0] = -8 -> -8/2 = -4 -> code 0xE.
  if (scales[0] != 128 || (codes[0] & 0xF) != 0xE) {
    std::printf("downstream: unexpected scale %d code %d\n", scales[0], codes[0] & 0xF);
    return 1;
  }
  std::printf("downstream: mxq %s works through find_package\n", MXQ_VERSION_STRING);
  return 0;
}
