// The mxq command-line tool. One subcommand per task; errors are one line on stderr and a non-zero
// exit status.
#include <charconv>
#include <csignal>
#include <cstdio>
#include <exception>

#include <CLI/CLI.hpp>

#include <mxq/mxq.hpp>

#include "checkpoint_read.hpp"
#include "commands.hpp"
#include "staging.hpp"

int main(int argc, char** argv) {
  CLI::App app{"mxq: microscaling formats (MXFP4/6/8, MXINT8, NVFP4) - quantize, dequantize, QDQ, inspect"};
  app.require_subcommand(1);
  app.set_version_flag("--version", MXQ_VERSION_STRING);

  mxq::cli::DemoArgs demo;
  CLI::App* c_demo = app.add_subcommand("demo", "every format x scale rule on an LLM-like workload: error and throughput");
  c_demo->add_option("--weight-rows", demo.weight_rows, "rows of the weight matrix (default 4096 on a GPU, 1024 on a CPU)")
      ->check(CLI::PositiveNumber);
  c_demo->add_option("--activation-rows", demo.activation_rows, "rows of the activation matrix (default 2048 on a GPU, 256 on a CPU)")
      ->check(CLI::PositiveNumber);
  c_demo->add_option("-K,--cols", demo.K, "columns of both")->check(CLI::PositiveNumber);
  c_demo->add_option("--device", demo.device, "cpu, cuda or auto")->capture_default_str();

  mxq::cli::InspectArgs inspect;
  CLI::App* c_inspect = app.add_subcommand("inspect", "tensors, dtypes, shapes and bytes of a safetensors file or checkpoint directory");
  c_inspect->add_option("file", inspect.file, "a .safetensors file or a checkpoint directory (every shard)")->required();
  CLI::Option* against_opt = c_inspect->add_option("--against", inspect.against,
                        "original .safetensors file or checkpoint directory: per-tensor error (quantized modules dequantized)");
  c_inspect->add_option("--device", inspect.device, "where --against dequantizes: cpu, cuda or auto")
      ->capture_default_str()
      ->needs(against_opt);

  mxq::cli::QuantizeArgs quant;
  CLI::App* c_quant = app.add_subcommand("quantize", "a safetensors checkpoint to the compressed-tensors layout vLLM loads");
  c_quant->add_option("in", quant.in, "a .safetensors file or a checkpoint directory")->required();
  c_quant->add_option("-o,--output", quant.out, "output directory")->required();
  c_quant->add_flag("--overwrite", quant.overwrite, "replace the contents of a non-empty output directory");
  c_quant->add_option("--format", quant.format, "mxfp4, mxfp8 or nvfp4")->capture_default_str();
  c_quant->add_option("--rule", quant.rule,
                     "MX scale rule: floor, ceil, even, rceil or even_fp4 (default: compressed-tensors' rule, even for "
                     "mxfp4, even_fp4 for mxfp8)");
  c_quant->add_option("--include", quant.include, "quantize only weights whose name matches this regex (repeatable)");
  c_quant->add_option("--exclude", quant.exclude, "leave weights whose name matches this regex (repeatable)");
  c_quant->add_option("--device", quant.device, "cpu, cuda or auto")->capture_default_str();
  c_quant->add_option("--gpus", quant.gpus, "with a GPU: how many of the visible GPUs convert tensors side by side (0: all)")
      ->check(CLI::Range(0, 4096))->capture_default_str();
  c_quant->add_option("--rotate", quant.rotate,
                      "had<RS> (RS 16..256): rotate each quantized Linear's input by the normalised "
                      "Hadamard transform per block of RS (the weight here, the activations by the loader: "
                      "compressed-tensors' transform_config, which vLLM applies)");
  c_quant->add_option_function<std::string>("--part", [&](const std::string& s) { quant.part = s; },
                      "I/N: convert only every N-th shard starting at the I-th, into OUTPUT.part-I-of-N; then `mxq merge "
                      "OUTPUT` (spread a large checkpoint over a Slurm array, torchrun or Ray workers)");

  mxq::cli::QuantizeArgs fq;
  fq.fake = true;
  CLI::App* c_qdq = app.add_subcommand("qdq", "a fake-quantized copy of a checkpoint, weights in their original dtype");
  c_qdq->add_option("in", fq.in, "a .safetensors file or a checkpoint directory")->required();
  c_qdq->add_option("-o,--output", fq.out, "output directory")->required();
  c_qdq->add_flag("--overwrite", fq.overwrite, "replace the contents of a non-empty output directory");
  c_qdq->add_option("--format", fq.format,
                    "any format: mxfp4, mxfp6_e2m3, mxfp6_e3m2, mxfp8_e4m3, mxfp8_e5m2, mxint8, nvfp4, nvfp4_e5m3")
      ->capture_default_str();
  c_qdq->add_option("--rule", fq.rule,
                   "MX scale rule: floor, ceil, even or rceil (every MX format), even_fp4 (mxfp4, mxfp8), quest or "
                   "qutlass_absmax (mxfp4); nvfp4_e5m3 takes its own rule only (default: even_fp4 for mxfp8, even for the "
                   "other MX formats)");
  c_qdq->add_option("--include", fq.include, "fake-quantize only weights whose name matches this regex (repeatable)");
  c_qdq->add_option("--exclude", fq.exclude, "leave weights whose name matches this regex (repeatable)");
  c_qdq->add_option("--device", fq.device, "cpu, cuda or auto")->capture_default_str();
  c_qdq->add_option("--gpus", fq.gpus, "with a GPU: how many of the visible GPUs convert tensors side by side (0: all)")
      ->check(CLI::Range(0, 4096))->capture_default_str();
  c_qdq->add_option("--rotate", fq.rotate,
                    "had<RS> or rhad<RS> (RS 16..256): rotate each weight's groups of RS before quantizing and rotate back "
                    "after (the weights stay in the model's domain); weights whose K is not a multiple of RS are left "
                    "unchanged");
  c_qdq->add_option_function<std::string>(
      "--rotate-seed",
      [&](const std::string& s) {
        // NOTE: parsed here, not by CLI11's integer conversion, which took -1 and values past 2^64 - 1
        // without a word
        std::uint64_t v = 0;
        const auto [end, ec] = std::from_chars(s.data(), s.data() + s.size(), v);
        if (s.empty() || ec != std::errc() || end != s.data() + s.size())
          throw CLI::ValidationError("--rotate-seed", "'" + s + "': expected a decimal integer from 0 to 18446744073709551615");
        fq.rotate_seed = v;
      },
      "the seed of rhad's random signs (with --rotate rhad<RS> only; default 0)");
  c_qdq->add_option_function<std::string>("--part", [&](const std::string& s) { fq.part = s; },
                                          "I/N: one part of the conversion, as for quantize (then `mxq merge OUTPUT`)");

  mxq::cli::MergeArgs merge;
  CLI::App* c_merge = app.add_subcommand("merge", "assemble OUTPUT from the parts OUTPUT.part-I-of-N of `quantize|qdq --part I/N`");
  c_merge->add_option("output", merge.out, "the output directory the parts were given")->required();
  c_merge->add_flag("--overwrite", merge.overwrite, "replace the contents of a non-empty output directory");
  c_merge->add_flag("--keep-parts", merge.keep_parts, "leave the part directories (default: removed after the merge)");

  mxq::cli::DequantizeArgs deq;
  CLI::App* c_deq = app.add_subcommand("dequantize", "a compressed-tensors checkpoint back to bf16/f16/f32 weights");
  c_deq->add_option("in", deq.in, "a .safetensors file or a checkpoint directory")->required();
  c_deq->add_option("-o,--output", deq.out, "output directory")->required();
  c_deq->add_flag("--overwrite", deq.overwrite, "replace the contents of a non-empty output directory");
  c_deq->add_option("--dtype", deq.dtype, "bf16, f16 or f32")->capture_default_str();
  c_deq->add_option("--device", deq.device, "cpu, cuda or auto")->capture_default_str();

  mxq::cli::BenchArgs bench;
  CLI::App* c_bench = app.add_subcommand("bench", "time each operation x format on each usable backend");
  c_bench->add_option("--shape", bench.shapes, "ROWSxCOLS (repeatable)")->capture_default_str();
  c_bench->add_option("--format", bench.formats, "formats (repeatable)")->capture_default_str();
  c_bench->add_option("--op", bench.ops, "qdq, quantize, dequantize (repeatable; default all), linear (the W4A16 GEMM: --shape is the weight's N x K) or moe (the W4A16 MoE block: --shape is H x I)")
      ->check(CLI::IsMember({"qdq", "quantize", "dequantize", "linear", "moe"}));
  c_bench->add_option("--tokens", bench.tokens, "linear, moe: rows of x (repeatable)")->check(CLI::PositiveNumber)->capture_default_str();
  c_bench->add_option("--experts", bench.experts, "moe: E:k, E experts and the top-k routing")->capture_default_str();
  c_bench->add_option("--reps", bench.reps, "timed runs per case (median)")->check(CLI::PositiveNumber)->capture_default_str();
  c_bench->add_flag("!--no-reference", bench.reference, "skip the (slow) reference backend");
  c_bench->add_flag("!--no-gpu", bench.gpu, "skip the CUDA backend");

  mxq::cli::VerifyArgs verify;
  CLI::App* c_verify = app.add_subcommand("verify", "build, machine, usable backends, and a bit-exactness self-test");
  c_verify->add_flag("-v,--verbose", verify.verbose, "print the first differing bytes of a mismatch");

  CLI11_PARSE(app, argc, argv);
  // SIGINT, SIGTERM, SIGHUP: a conversion stops at the next tensor and removes what it staged. Only
  // the commands that write a checkpoint check for them; the others keep the default action (a
  // recorded signal that nothing checks would make the first Ctrl-C do nothing).
  if (*c_quant || *c_deq || *c_qdq || *c_merge) mxq::cli::install_interrupt_handlers();
  try {
    if (*c_demo) return mxq::cli::run_demo(demo);
    if (*c_inspect) return mxq::cli::run_inspect(inspect);
    if (*c_verify) return mxq::cli::run_verify(verify);
    if (*c_quant) return mxq::cli::run_quantize(quant);
    if (*c_deq) return mxq::cli::run_dequantize(deq);
    if (*c_qdq) return mxq::cli::run_quantize(fq);
    if (*c_merge) return mxq::cli::run_merge(merge);
    if (*c_bench) return mxq::cli::run_bench(bench);
  } catch (const std::exception& e) {  // mxq::st::Error, mxq::Error, filesystem and other errors alike
    if (const int sig = mxq::cli::interrupt_signal()) {
      // The stack has unwound (the staging directory is gone): end as the signal would have.
      std::fprintf(stderr, "mxq: %s; nothing was written to the output\n", mxq::cli::Interrupted(sig).what());
      std::signal(sig, SIG_DFL);
      std::raise(sig);
    }
    std::fprintf(stderr, "mxq: %s\n", mxq::cli::printable(e.what()).c_str());  // names from files, escaped
    return 2;
  }
  return 0;
}
