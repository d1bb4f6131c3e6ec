#pragma once
// Argument checks shared by the entry points. Each throws mxq::Error naming the function, the
// argument, what it got and what was expected.
#include <cstdint>
#include <string>
#include <vector>

#include <mxq/fp_env.hpp>
#include <mxq/ops.hpp>

#include "core/problem.hpp"

namespace mxq::core {

[[noreturn]] void fail(Error::Code code, const std::string& fn, const std::string& msg);

struct Span {
  const char* name;
  std::uintptr_t begin, end;  // [begin, end) bytes
};

// Every public operation constructs one first. It also holds the host's floating-point environment at
// IEEE subnormals for the operation's duration (mxq/fp_env.hpp: a caller's flush-to-zero would change the
// CPU backends' bytes); parallel loops do the same on their worker threads.
class Checker {
 public:
  explicit Checker(const char* fn) : fn_(fn) {}
  const char* fn() const { return fn_; }

  // A view must have the given dtype and shape, unit element stride, row_stride >= cols, data
  // non-null when it has elements, and sit on `device`.
  void view(const char* arg, const Tensor& t, DType dtype, std::int64_t rows, std::int64_t cols,
            bool dense_required = false);
  void float_view(const char* arg, const Tensor& t);  // any of f32, f16, bf16 with sane geometry
  void same_device(const char* arg, const Tensor& t, Device d);
  // Output buffers may not overlap each other or the inputs (except an explicitly allowed alias).
  void no_overlap() const;
  void record(const char* arg, const Tensor& t, bool writable);
  [[noreturn]] void fail(const std::string& msg) const { core::fail(Error::Code::invalid_argument, fn_, msg); }
  [[noreturn]] void unsupported(const std::string& msg) const { core::fail(Error::Code::unsupported, fn_, msg); }

 private:
  void geometry(const char* arg, const Tensor& t) const;
  const char* fn_;
  std::vector<Span> inputs_, outputs_;
  IeeeSubnormalScope ieee_;
};

// Validate options and fill a Problem (rows/K given by the caller).
Problem make_problem(const Checker& c, const QuantOptions& opt, std::int64_t rows, std::int64_t K);

std::string shape_str(std::int64_t r, std::int64_t c);

}  // namespace mxq::core
