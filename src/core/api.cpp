// The public entry points: validate at the boundary, plan, dispatch to one backend.
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <string>

#include <mxq/ops.hpp>

#include "core/validate.hpp"
#include "cpu/fast.hpp"
#include "cpu/reference/reference.hpp"
#if defined(MXQ_HAVE_CUDA)
#include "cuda/backend.hpp"
#endif

namespace mxq {
namespace core {

void fail(Error::Code code, const std::string& fn, const std::string& msg) {
  throw Error(code, "mxq::" + fn + ": " + msg);
}

std::string shape_str(std::int64_t r, std::int64_t c) {
  return "[" + std::to_string(r) + ", " + std::to_string(c) + "]";
}

void Checker::geometry(const char* arg, const Tensor& t) const {
  if (t.rows < 0 || t.cols < 0)
    fail(std::string("argument '") + arg + "': negative shape " + shape_str(t.rows, t.cols));
  if (t.row_stride < 0 || (t.row_stride != 0 && t.row_stride < t.cols))
    fail(std::string("argument '") + arg + "': row_stride " + std::to_string(t.row_stride) +
         " must be 0 (dense) or >= cols (" + std::to_string(t.cols) + ")");
  constexpr std::int64_t kMax = std::int64_t(1) << 46;  // keeps every byte offset far from overflow
  if (t.rows > kMax || t.stride() > kMax || (t.rows > 0 && t.stride() > kMax / t.rows))
    fail(std::string("argument '") + arg + "': shape " + shape_str(t.rows, t.cols) + " with row_stride " +
         std::to_string(t.stride()) + " is too large");
  if (t.data == nullptr && t.rows > 0 && t.cols > 0)
    fail(std::string("argument '") + arg + "': data is null for a non-empty " + shape_str(t.rows, t.cols) +
         " view");
}

void Checker::view(const char* arg, const Tensor& t, DType dtype, std::int64_t rows, std::int64_t cols,
                   bool dense_required) {
  if (t.dtype != dtype)
    fail(std::string("argument '") + arg + "': dtype " + std::string(to_string(t.dtype)) + ", expected " +
         std::string(to_string(dtype)));
  if (t.rows != rows || t.cols != cols)
    fail(std::string("argument '") + arg + "': shape " + shape_str(t.rows, t.cols) + ", expected " +
         shape_str(rows, cols));
  geometry(arg, t);
  if (dense_required && t.stride() != t.cols)
    fail(std::string("argument '") + arg + "': must be dense (row_stride 0 or " + std::to_string(t.cols) +
         "), got row_stride " + std::to_string(t.row_stride));
}

void Checker::float_view(const char* arg, const Tensor& t) {
  if (t.dtype == DType::u8)
    fail(std::string("argument '") + arg + "': dtype u8, expected f32, f16 or bf16");
  geometry(arg, t);
}

void Checker::same_device(const char* arg, const Tensor& t, Device d) {
  if (t.device != d)
    fail(std::string("argument '") + arg + "' is on " + (t.device == Device::cpu ? "cpu" : "cuda") +
         " but the input is on " + (d == Device::cpu ? "cpu" : "cuda") + "; all views must be on one device");
}

void Checker::record(const char* arg, const Tensor& t, bool writable) {
  if (t.rows == 0 || t.cols == 0 || t.data == nullptr) return;
  const auto b = reinterpret_cast<std::uintptr_t>(t.data);
  const auto bytes = static_cast<std::uintptr_t>(((t.rows - 1) * t.stride() + t.cols) * dtype_size(t.dtype));
  (writable ? outputs_ : inputs_).push_back(Span{arg, b, b + bytes});
}

void Checker::no_overlap() const {
  auto overlap = [](const Span& a, const Span& b) { return a.begin < b.end && b.begin < a.end; };
  for (std::size_t i = 0; i < outputs_.size(); ++i) {
    for (std::size_t j = i + 1; j < outputs_.size(); ++j)
      if (overlap(outputs_[i], outputs_[j]))
        fail(std::string("outputs '") + outputs_[i].name + "' and '" + outputs_[j].name + "' overlap in memory");
    for (const Span& in : inputs_)
      if (overlap(outputs_[i], in))
        fail(std::string("output '") + outputs_[i].name + "' overlaps input '" + in.name + "'");
  }
}

Problem make_problem(const Checker& c, const QuantOptions& opt, std::int64_t rows, std::int64_t K) {
  Problem p;
  p.opt = opt;
  if (static_cast<unsigned>(opt.format) > static_cast<unsigned>(Format::nvfp4))
    c.fail("option 'format': invalid value " + std::to_string(int(opt.format)));
  if (static_cast<unsigned>(opt.rule) > static_cast<unsigned>(ScaleRule::nvfp4))
    c.fail("option 'rule': invalid value " + std::to_string(int(opt.rule)));
  p.info = format_info(opt.format);
  p.elem = elem_spec(p.info.elem);
  const std::string fmt(to_string(opt.format)), rule(to_string(opt.rule));
  if (opt.format == Format::nvfp4 && opt.rule != ScaleRule::nvfp4)
    c.fail("option 'rule': format nvfp4 uses rule 'nvfp4' (E4M3 block scale with a tensor scale), got '" + rule +
           "'");
  if (opt.format != Format::nvfp4 && opt.rule == ScaleRule::nvfp4)
    c.fail("option 'rule': rule 'nvfp4' needs format nvfp4, got format '" + fmt + "'");
  if (opt.rule == ScaleRule::qutlass_absmax && opt.format != Format::mxfp4)
    c.fail("option 'rule': rule 'qutlass_absmax' is defined for mxfp4 only, got format '" + fmt + "'");
  const int g = group_size(opt);
  if (g < 2 || g > 256 || (g & (g - 1)) != 0)
    c.fail("option 'group_size': " + std::to_string(opt.group_size) + ", expected 0 (format default) or a power of two in [2, 256]");
  if (opt.rounding != Rounding::nearest_even && opt.rounding != Rounding::stochastic)
    c.fail("option 'rounding': invalid value " + std::to_string(int(opt.rounding)));
  if (opt.scale_layout != ScaleLayout::linear && opt.scale_layout != ScaleLayout::swizzled)
    c.fail("option 'scale_layout': invalid value " + std::to_string(int(opt.scale_layout)));
  if (opt.tensor_scale) {
    if (opt.format != Format::nvfp4)
      c.fail("option 'tensor_scale' is only used by format nvfp4, got format '" + fmt + "'");
    const float s = *opt.tensor_scale;
    if (!(s > 0.0f) || !is_finite_bits(f2u(s)))
      c.fail("option 'tensor_scale': " + std::to_string(s) + ", expected a finite value > 0 (the encode scale 448*6/amax)");
  }
  p.rows = rows;
  p.K = K;
  p.g = g;
  p.nblocks = (K + g - 1) / g;
  p.scale_rows_padded = (rows + 127) / 128 * 128;
  p.scale_cols_padded = (p.nblocks + 3) / 4 * 4;
  p.stochastic = opt.rounding == Rounding::stochastic;
  p.fp4 = p.info.elem_bits == 4;
  p.S = opt.tensor_scale.value_or(1.0f);
  return p;
}

}  // namespace core

bool cuda_compiled() {
#if defined(MXQ_HAVE_CUDA)
  return true;
#else
  return false;
#endif
}

bool cuda_available(std::string* why_not) {
#if defined(MXQ_HAVE_CUDA)
  return cuda::available(why_not);
#else
  if (why_not) *why_not = "this build of mxq has no CUDA backend (configured without a CUDA compiler or with MXQ_ENABLE_CUDA=OFF)";
  return false;
#endif
}

namespace {
// The device probe runs once per process.
bool cuda_available_cached(std::string* why_not) {
  static std::string reason;
  static const bool ok = cuda_available(&reason);
  if (why_not) *why_not = reason;
  return ok;
}
}  // namespace

BackendChoice choose_backend(Backend requested, Device dev) {
  Backend b = requested;
  std::string why;
  if (static_cast<unsigned>(b) > static_cast<unsigned>(Backend::cuda))
    throw Error(Error::Code::invalid_argument, "mxq: invalid backend value " + std::to_string(int(b)));
  if (b == Backend::automatic) {
    if (const char* env = std::getenv("MXQ_BACKEND"); env && *env) {
      b = parse_backend(env);
      why = "forced by MXQ_BACKEND=" + std::string(env);
    }
  } else {
    why = "requested explicitly";
  }
  if (b == Backend::automatic) {
    if (dev == Device::cpu) return {Backend::cpu, "data on the CPU: the fast multi-threaded CPU path"};
    if (!cuda_compiled())
      throw Error(Error::Code::backend_unavailable,
                  "mxq: data is on a CUDA device but this build of mxq has no CUDA backend (no data is copied to the host)");
    std::string why_not;
    if (!cuda_available_cached(&why_not))
      throw Error(Error::Code::backend_unavailable, "mxq: data is on a CUDA device but the CUDA backend cannot run: " + why_not);
    return {Backend::cuda, "data on a CUDA device: the CUDA kernels"};
  }
  if ((b == Backend::cpu || b == Backend::reference) && dev != Device::cpu)
    throw Error(Error::Code::backend_unavailable, "mxq: backend '" + std::string(to_string(b)) +
                                                      "' (" + why + ") needs data on the CPU, but the data is on a CUDA device (no data is copied)");
  if (b == Backend::cuda) {
    if (!cuda_compiled())
      throw Error(Error::Code::backend_unavailable,
                  "mxq: backend 'cuda' (" + why + ") is not available: this build of mxq has no CUDA backend");
    if (dev != Device::cuda)
      throw Error(Error::Code::backend_unavailable,
                  "mxq: backend 'cuda' (" + why + ") needs data on a CUDA device, but the data is on the CPU (no data is copied)");
    std::string why_not;
    if (!cuda_available_cached(&why_not))
      throw Error(Error::Code::backend_unavailable, "mxq: backend 'cuda' (" + why + ") cannot run: " + why_not);
  }
  return {b, why};
}

namespace {

using core::Checker;
using core::Problem;

// MXQ_VERBOSE=1: one line on stderr per operation saying which backend ran it and why.
void log_choice(const char* fn, const QuantOptions* opt, const Tensor& t, const BackendChoice& bc) {
  static const bool verbose = [] {
    const char* v = std::getenv("MXQ_VERBOSE");
    return v && *v && std::string(v) != "0";
  }();
  if (!verbose) return;
  std::string what = std::string(to_string(t.dtype)) + " " + core::shape_str(t.rows, t.cols);
  if (opt)
    what += " " + std::string(to_string(opt->format)) + "/" + std::string(to_string(opt->rule)) +
            (opt->rounding == Rounding::stochastic ? "/stochastic" : "");
  std::fprintf(stderr, "mxq: %s %s -> %s (%s)\n", fn, what.c_str(), std::string(to_string(bc.backend)).c_str(),
               bc.reason.c_str());
}

// NVFP4: the encode scale from the options, or from the tensor's amax (CPU backends; the CUDA backend
// reduces the amax on the device).
void resolve_tensor_scale(Problem& p, const Tensor& x, Backend b) {
  if (!p.nvfp4() || p.opt.tensor_scale || b == Backend::cuda) return;
  const float amax = b == Backend::reference ? ref::tensor_amax(x) : cpu::tensor_amax(x);
  p.S = core::nvfp4_encode_scale(amax);
}

}  // namespace

void quantize(const Tensor& x, const QuantizedOut& out, const QuantOptions& opt) {
  Checker c("quantize");
  c.float_view("x", x);
  Problem p = core::make_problem(c, opt, x.rows, x.cols);
  c.view("codes", out.codes, DType::u8, x.rows, code_cols(opt.format, x.cols));
  const Shape2 ss = scale_shape(opt, x.rows, x.cols);
  c.view("scales", out.scales, DType::u8, ss.rows, ss.cols, opt.scale_layout == ScaleLayout::swizzled);
  c.same_device("codes", out.codes, x.device);
  c.same_device("scales", out.scales, x.device);
  if (out.clip_mask.data) {
    const Shape2 ms = clip_mask_shape(x.rows, x.cols);
    c.view("clip_mask", out.clip_mask, DType::u8, ms.rows, ms.cols);
    c.same_device("clip_mask", out.clip_mask, x.device);
  }
  c.record("x", x, false);
  c.record("codes", out.codes, true);
  c.record("scales", out.scales, true);
  if (out.clip_mask.data) c.record("clip_mask", out.clip_mask, true);
  c.no_overlap();
  const BackendChoice bc = choose_backend(opt.backend, x.device);
  log_choice("quantize", &opt, x, bc);
#if defined(MXQ_HAVE_CUDA)
  if (bc.backend == Backend::cuda) return cuda::quantize("quantize", p, x, out);
#endif
  if (x.rows == 0 || x.cols == 0) {
    if (out.tensor_scale) *out.tensor_scale = p.S;
    if (opt.scale_layout == ScaleLayout::swizzled && ss.rows * ss.cols > 0) std::memset(out.scales.data, 0, ss.rows * ss.cols);
    return;
  }
  resolve_tensor_scale(p, x, bc.backend);
  if (bc.backend == Backend::reference)
    ref::quantize(p, x, out);
  else
    cpu::quantize(p, x, out);
  if (out.tensor_scale) *out.tensor_scale = p.S;
}

void dequantize(const QuantizedIn& q, const Tensor& y, const QuantOptions& opt) {
  Checker c("dequantize");
  c.float_view("y", y);
  const Problem p = core::make_problem(c, opt, y.rows, y.cols);
  if (opt.format == Format::nvfp4 && !opt.tensor_scale)
    c.fail("option 'tensor_scale': dequantizing nvfp4 needs the encode scale S that quantize used");
  c.view("codes", q.codes, DType::u8, y.rows, code_cols(opt.format, y.cols));
  const Shape2 ss = scale_shape(opt, y.rows, y.cols);
  c.view("scales", q.scales, DType::u8, ss.rows, ss.cols, opt.scale_layout == ScaleLayout::swizzled);
  c.same_device("codes", q.codes, y.device);
  c.same_device("scales", q.scales, y.device);
  c.record("codes", q.codes, false);
  c.record("scales", q.scales, false);
  c.record("y", y, true);
  c.no_overlap();
  const BackendChoice bc = choose_backend(opt.backend, y.device);
  log_choice("dequantize", &opt, y, bc);
#if defined(MXQ_HAVE_CUDA)
  if (bc.backend == Backend::cuda) return cuda::dequantize("dequantize", p, q, y);
#endif
  if (y.rows == 0 || y.cols == 0) return;
  if (bc.backend == Backend::reference)
    ref::dequantize(p, q, y);
  else
    cpu::dequantize(p, q, y);
}

void qdq(const Tensor& x, const Tensor& y, const QuantOptions& opt) {
  Checker c("qdq");
  c.float_view("x", x);
  Problem p = core::make_problem(c, opt, x.rows, x.cols);
  c.view("y", y, x.dtype, x.rows, x.cols);
  c.same_device("y", y, x.device);
  const bool in_place = y.data == x.data && y.stride() == x.stride();
  if (!in_place) {
    c.record("x", x, false);
    c.record("y", y, true);
    c.no_overlap();
  }
  const BackendChoice bc = choose_backend(opt.backend, x.device);
  log_choice("qdq", &opt, x, bc);
#if defined(MXQ_HAVE_CUDA)
  if (bc.backend == Backend::cuda) return cuda::qdq("qdq", p, x, y);
#endif
  if (x.rows == 0 || x.cols == 0) return;
  resolve_tensor_scale(p, x, bc.backend);
  if (bc.backend == Backend::reference)
    ref::qdq(p, x, y);
  else
    cpu::qdq(p, x, y);
}

namespace {

// Validation shared by swizzle_scales and unswizzle_scales: `linear` is [R, C] u8 (any row stride),
// `swizzled` its dense padded [ceil(R/128)*128, ceil(C/4)*4] form; `to_swizzled` says which is written.
Backend check_scale_pair(const char* fn, const Tensor& linear, const Tensor& swizzled, bool to_swizzled, Backend backend) {
  Checker c(fn);
  c.view("linear", linear, DType::u8, linear.rows, linear.cols);
  c.view("swizzled", swizzled, DType::u8, (linear.rows + 127) / 128 * 128, (linear.cols + 3) / 4 * 4, true);
  c.same_device("swizzled", swizzled, linear.device);
  c.record("linear", linear, !to_swizzled);
  c.record("swizzled", swizzled, to_swizzled);
  c.no_overlap();
  const BackendChoice bc = choose_backend(backend, linear.device);
  log_choice(fn, nullptr, linear, bc);
  return bc.backend;
}

}  // namespace

void swizzle_scales(const Tensor& linear, const Tensor& swizzled, Backend backend, void* stream) {
  const Backend b = check_scale_pair("swizzle_scales", linear, swizzled, true, backend);
#if defined(MXQ_HAVE_CUDA)
  if (b == Backend::cuda) return cuda::swizzle_scales(linear, swizzled, stream);
#else
  (void)stream;
#endif
  if (swizzled.rows * swizzled.cols == 0) return;
  if (b == Backend::reference)
    ref::swizzle_scales(linear, swizzled);
  else
    cpu::swizzle_scales(linear, swizzled);
}

void unswizzle_scales(const Tensor& swizzled, const Tensor& linear, Backend backend, void* stream) {
  const Backend b = check_scale_pair("unswizzle_scales", linear, swizzled, false, backend);
#if defined(MXQ_HAVE_CUDA)
  if (b == Backend::cuda) return cuda::unswizzle_scales(swizzled, linear, stream);
#else
  (void)stream;
#endif
  if (linear.rows * linear.cols == 0) return;
  if (b == Backend::reference)
    ref::unswizzle_scales(swizzled, linear);
  else
    cpu::unswizzle_scales(swizzled, linear);
}

float tensor_amax(const Tensor& x, Backend backend, void* stream) {
  Checker c("tensor_amax");
  c.float_view("x", x);
  const BackendChoice bc = choose_backend(backend, x.device);
  log_choice("tensor_amax", nullptr, x, bc);
#if defined(MXQ_HAVE_CUDA)
  if (bc.backend == Backend::cuda) return cuda::tensor_amax(x, stream);
#else
  (void)stream;
#endif
  if (x.rows == 0 || x.cols == 0) return 0.0f;
  return bc.backend == Backend::reference ? ref::tensor_amax(x) : cpu::tensor_amax(x);
}

}  // namespace mxq
