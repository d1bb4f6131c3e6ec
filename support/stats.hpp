#pragma once
// The one median of mxq's benchmarks (bench/cpu_bench, bench/cuda_bench, `mxq bench`): the middle
// value, or the mean of the two middle values of an even count.
#include <algorithm>
#include <stdexcept>
#include <vector>

namespace mxq::bench {

inline double median(std::vector<double> v) {
  if (v.empty()) throw std::invalid_argument("median of no values");
  std::sort(v.begin(), v.end());
  const std::size_t n = v.size();
  return n % 2 ? v[n / 2] : 0.5 * (v[n / 2 - 1] + v[n / 2]);
}

}  // namespace mxq::bench
