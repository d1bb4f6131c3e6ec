#pragma once
// Error statistics of a conversion computed on the GPU, beside the kernels (the tool's GPU engine):
// the input and the converted values are on the device already, so only four numbers come back.
#include <cstdint>

#include <mxq/types.hpp>

namespace mxq::cli {

// sum (y - x)^2 and sum x^2 over the elements where both are finite, in double; bad_in: elements
// where x is not finite; bad_out: x finite but y not (as the host's ErrorSum counts them).
struct ErrorTotals {
  double e = 0, r = 0;
  std::int64_t bad_in = 0, bad_out = 0;
};

namespace gpu {

// Doubles of device scratch error_totals needs (its per-block partial sums).
constexpr int kErrorPartials = 4 * 1024;

// Enqueues the totals of n dense elements of x (dtype xt: f32, bf16 or f16) against y (dtype yt),
// device pointers, on stream `stream` (a cudaStream_t): a fixed grid's per-block sums into `partials`
// (device scratch of kErrorPartials doubles), copied to `host_partials` (page-locked, as many). Returns
// at once; throws std::runtime_error on a launch error.
void error_totals_async(const void* x, DType xt, const void* y, DType yt, std::int64_t n, double* partials,
                        double* host_partials, void* stream);
// The totals from host_partials once the stream has passed the copy: the blocks' sums added in block
// order (the same figures on every run of a given GPU).
ErrorTotals sum_partials(const double* host_partials);

}  // namespace gpu
}  // namespace mxq::cli
