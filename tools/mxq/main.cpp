// The mxq command-line tool. One subcommand per task; errors are one line on stderr and a non-zero
// exit status.
#include <cstdio>
#include <exception>

#include <CLI/CLI.hpp>

#include <mxq/mxq.hpp>

#include "commands.hpp"
#include "safetensors.hpp"

int main(int argc, char** argv) {
  CLI::App app{"mxq: microscaling formats (MXFP4/6/8, MXINT8, NVFP4) - quantize, dequantize, QDQ, inspect"};
  app.require_subcommand(1);
  app.set_version_flag("--version", MXQ_VERSION_STRING);

  mxq::cli::DemoArgs demo;
  CLI::App* c_demo = app.add_subcommand("demo", "every format x scale rule on an LLM-like workload: error and throughput");
  c_demo->add_option("--weight-rows", demo.weight_rows, "rows of the weight matrix")->check(CLI::PositiveNumber);
  c_demo->add_option("--activation-rows", demo.activation_rows, "rows of the activation matrix")->check(CLI::PositiveNumber);
  c_demo->add_option("-K,--cols", demo.K, "columns of both")->check(CLI::PositiveNumber);

  mxq::cli::InspectArgs inspect;
  CLI::App* c_inspect = app.add_subcommand("inspect", "tensors, dtypes, shapes and bytes of a safetensors file");
  c_inspect->add_option("file", inspect.file, "a .safetensors file")->required();

  mxq::cli::VerifyArgs verify;
  CLI::App* c_verify = app.add_subcommand("verify", "build, machine, usable backends, and a bit-exactness self-test");
  c_verify->add_flag("-v,--verbose", verify.verbose, "print the first differing bytes of a mismatch");

  CLI11_PARSE(app, argc, argv);
  try {
    if (*c_demo) return mxq::cli::run_demo(demo);
    if (*c_inspect) return mxq::cli::run_inspect(inspect);
    if (*c_verify) return mxq::cli::run_verify(verify);
  } catch (const mxq::st::Error& e) {
    std::fprintf(stderr, "mxq: %s\n", e.what());
    return 2;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "mxq: %s\n", e.what());
    return 2;
  }
  return 0;
}
