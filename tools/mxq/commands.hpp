#pragma once
// The subcommands of the mxq tool; each returns the process exit status.
#include <cstdint>
#include <string>

namespace mxq::cli {

struct DemoArgs {
  std::int64_t weight_rows = 1024, activation_rows = 256, K = 4096;
};
int run_demo(const DemoArgs& args);

struct InspectArgs {
  std::string file;
};
int run_inspect(const InspectArgs& args);

struct VerifyArgs {
  bool verbose = false;
};
int run_verify(const VerifyArgs& args);

}  // namespace mxq::cli
