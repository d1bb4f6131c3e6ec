#pragma once
// The subcommands of the mxq tool; each returns the process exit status.
#include <cstdint>
#include <optional>
#include <string>
#include <vector>

namespace mxq::cli {

struct DemoArgs {
  std::int64_t weight_rows = 0, activation_rows = 0, K = 4096;  // rows 0: 4096 and 2048 on a GPU, 1024 and 256 on a CPU
  std::string device = "auto";
};
int run_demo(const DemoArgs& args);

struct InspectArgs {
  std::string file, against, device = "auto";  // device: where --against dequantizes (auto, cpu, cuda)
};
int run_inspect(const InspectArgs& args);
int run_inspect_against(const std::string& file, const std::string& original, const std::string& device = "auto");

struct QuantizeArgs {
  std::string in, out, format = "mxfp4", rule, device = "auto";
  std::vector<std::string> include, exclude;  // regular expressions searched in tensor names
  bool fake = false;  // mxq qdq: write the fake-quantized weights in their own dtype instead
  bool overwrite = false;  // replace a non-empty output directory
  // "I/N" (1 <= I <= N): convert only shards i with i % N == I - 1 (in the index's order) into the
  // directory OUT.part-I-of-N, with a manifest; `mxq merge OUT` assembles the parts (docs/cli.md).
  // Not given: the whole checkpoint; given empty (an unset variable in a launcher): refused.
  std::optional<std::string> part;
  // mxq qdq: "had<RS>" or "rhad<RS>": each weight is rotated, quantized, dequantized and rotated back
  // (the error a rotated quantized weight carries, in the model's own domain). mxq quantize: "had<RS>":
  // each quantized weight stored rotated, with compressed-tensors' transform_config telling the loader
  // to rotate the activations (docs/cli.md).
  std::string rotate;
  // mxq qdq --rotate rhad<RS>: the seed of the random signs (0 when not given); refused with any
  // other rotation or none.
  std::optional<std::uint64_t> rotate_seed;
  // With a GPU device: how many of the visible GPUs convert tensors side by side (0: all of them).
  int gpus = 0;
  // With a GPU device the first tensors are converted on the CPU while the GPU is set up (the same
  // bytes); the tests that compare the devices turn that off. Not a command-line option.
  bool cpu_while_gpu_sets_up = true;
};
int run_quantize(const QuantizeArgs& args);

struct MergeArgs {
  std::string out;         // OUT: the parts are OUT.part-I-of-N
  bool overwrite = false;  // replace a non-empty OUT
  bool keep_parts = false; // leave the part directories (OUT's shards are hard links to, or copies of, theirs)
};
int run_merge(const MergeArgs& args);

struct DequantizeArgs {
  std::string in, out, dtype = "bf16", device = "auto";
  bool overwrite = false;  // replace a non-empty output directory
};
int run_dequantize(const DequantizeArgs& args);

struct BenchArgs {
  std::vector<std::string> shapes{"1024x4096"};
  std::vector<std::string> formats{"mxfp4", "mxfp8_e4m3", "nvfp4"};
  std::vector<std::string> ops;  // empty: qdq, quantize, dequantize; "linear": the W4A16 GEMM (shape = N x K);
                                 // "moe": the W4A16 MoE block (shape = H x I)
  std::vector<std::int64_t> tokens{1, 16};  // linear, moe: rows of x
  std::string experts = "8:2";              // moe: E experts, top-k
  int reps = 10;
  bool reference = true, gpu = true;
};
int run_bench(const BenchArgs& args);

struct VerifyArgs {
  bool verbose = false;
};
int run_verify(const VerifyArgs& args);

}  // namespace mxq::cli
