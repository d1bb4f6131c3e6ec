#pragma once
// Shared by the entry points (src/ops.cpp, src/linear.cpp): the backend choice, done once per call.
#include <initializer_list>
#include <utility>

#include <mxq/types.hpp>

namespace mxq::detail {

// The backend for the data's device, logged under MXQ_VERBOSE; on the CUDA backend every non-null
// pointer named in device_ptrs is checked to be device memory of the current device (the last
// validation step, done once here). opt: the options to log, or nullptr. host_is_reference: the
// operation's only host implementation is the reference (the log says so where the CPU backend is chosen).
Backend choose(const char* fn, const QuantOptions* opt, const Tensor& first,
               std::initializer_list<std::pair<const char*, const void*>> device_ptrs, Backend requested,
               bool host_is_reference = false);

}  // namespace mxq::detail
