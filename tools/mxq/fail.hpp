#pragma once
// The tool's error path: one line naming the file, tensor or option, thrown to main(), which prints
// it and exits with status 1.
#include <stdexcept>
#include <string>

namespace mxq::cli {

[[noreturn]] inline void fail(const std::string& what) { throw std::runtime_error(what); }

}  // namespace mxq::cli
