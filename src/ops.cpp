// The public entry points: validate at the boundary, plan, dispatch to one backend.
#include <cstdio>
#include <cstdlib>
#include <cstdint>
#include <cstring>
#include <initializer_list>
#include <optional>
#include <string>
#include <utility>
#include <memory>
#include <vector>

#include <mxq/ops.hpp>

#include "core/validate.hpp"
#include "entry.hpp"
#include "cpu/fast.hpp"
#include "cpu/fused.hpp"
#include "cpu/rotation.hpp"
#include "cpu/reference/reference.hpp"
#if defined(MXQ_HAVE_CUDA)
#include "cuda/backend.hpp"
#endif

namespace mxq {

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
  std::string what(to_string(t.dtype));
  what += ' ';
  what += core::shape_str(t.rows, t.cols);
  // NOTE: appended piece by piece: GCC 12 warns (-Wrestrict, a false positive) on "literal" + string&&.
  if (opt) {
    what += ' ';
    what += to_string(opt->format);
    what += '/';
    what += to_string(opt->rule);
    if (opt->rounding == Rounding::stochastic) {
      what += "/stochastic";
      what += std::to_string(opt->random_bits);
    }
  }
  std::fprintf(stderr, "mxq: %s %s -> %s (%s)\n", fn, what.c_str(), std::string(to_string(bc.backend)).c_str(),
               bc.reason.c_str());
}

}  // namespace

Backend detail::choose(const char* fn, const QuantOptions* opt, const Tensor& first,
               std::initializer_list<std::pair<const char*, const void*>> device_ptrs, Backend requested,
               bool host_is_reference) {
  BackendChoice bc = choose_backend(requested, first.device);
  if (host_is_reference && bc.backend == Backend::cpu)
    bc.reason = bc.reason.substr(0, bc.reason.find(':')) + ": the reference, this operation's only host implementation";
  log_choice(fn, opt, first, bc);
#if defined(MXQ_HAVE_CUDA)
  if (bc.backend == Backend::cuda)
    for (const auto& [arg, ptr] : device_ptrs) cuda::check_device_pointer(fn, arg, ptr);
#else
  (void)device_ptrs;
#endif
  return bc.backend;
}

namespace {
using detail::choose;

// The plan's NVFP4 tensor scale (docs/numerics.md, "NVFP4"), for every backend alike: given; 1 for an
// empty tensor (the scale of amax 0); from the host amax for the CPU backends; on the CUDA backend
// reduced on the device into `acc` (quantize: its tensor-scale output, else the workspace), which the
// caller must provide. NVFP4 under rule quest: 1.
void plan_tensor_scale(const Checker& c, Problem& p, const Tensor& x, Backend b, float* tensor_scale_out) {
  if (p.nvfp4_quest()) return;  // S = 1 (make_problem)
  if (!p.nvfp4() || p.opt.tensor_scale) return;
  if (p.empty) {
    p.S = core::nvfp4_encode_scale(0.0f);
    return;
  }
  if (b != Backend::cuda) {
    p.S = core::nvfp4_encode_scale(b == Backend::reference ? ref::tensor_amax(x) : cpu::tensor_amax(x));
    return;
  }
  void* acc = tensor_scale_out ? static_cast<void*>(tensor_scale_out) : p.opt.workspace;
  if (!acc)
    c.fail(std::string("nvfp4 without option 'tensor_scale' on the CUDA backend needs ") +
           (std::string(c.fn()) == "quantize" ? "'tensor_scale' (output, device memory) or " : "") +
           "option 'workspace' (4 bytes of device memory) to reduce the tensor amax in");
  if (reinterpret_cast<std::uintptr_t>(acc) % 4)
    c.fail(tensor_scale_out ? "output 'tensor_scale' (the tensor amax accumulator) must be 4-byte aligned"
                            : "option 'workspace' must be 4-byte aligned");
  p.amax_acc = static_cast<std::uint32_t*>(acc);
}

// The CUDA backend rotates in its kernels, a rotation group over at most 32 lanes of 8 or 16 elements:
// groups of 2 and 4 elements (chunks of 2) are refused there.
// The matrix of Rotation::matrix that the op reads (R for quantize, qdq and tensor_amax; R^-1 for
// dequantize: `inverse`) is read where the backend runs: host memory for the CPU backends, device memory
// of the current device for the CUDA backend. The other one is not read and not checked.
void check_rotation_on_cuda(const Checker& c, const Problem& p, Backend b, bool inverse) {
  const Tensor& m = inverse ? p.opt.rotation_inverse : p.opt.rotation_matrix;
  const char* arg = inverse ? "rotation_inverse" : "rotation_matrix";
  if (p.opt.rotation == Rotation::matrix && m.data) {
    if (b != Backend::cuda && m.device != Device::cpu)
      c.fail(std::string("option '") + arg + "': in GPU memory, but the " + std::string(to_string(b)) +
             " backend reads it from host memory (the data is on the host)");
#if defined(MXQ_HAVE_CUDA)
    if (b == Backend::cuda) {
      if (m.device != Device::cuda)
        c.fail(std::string("option '") + arg + "': in host memory, but the CUDA backend reads it from device memory " +
               "(copy the matrix to the data's GPU)");
      cuda::check_device_pointer(c.fn(), arg, m.data);
    }
#endif
  }
  if (b == Backend::cuda && p.opt.rotation != Rotation::none && p.g < 8)
    c.unsupported("option 'rotation' with group_size = " + std::to_string(p.g) +
                  " on the CUDA backend: rotations there need groups of 8 or more elements (the CPU backends take any)");
}

// quantize and qdq rotate by R: a matrix rotation needs R there; its bf16 precision needs bf16 data and
// a bf16 R (the tensor cores' operands, exact).
void check_rotation_matrix(const Checker& c, const QuantOptions& opt, const Tensor& x) {
  if (opt.rotation == Rotation::matrix && !opt.rotation_matrix.data)
    c.fail("option 'rotation_matrix': missing (rotation 'matrix' needs the matrix R)");
  if (opt.rotation == Rotation::matrix && opt.matrix_precision == MatrixPrecision::bf16) {
    if (opt.rotation_matrix.dtype != DType::bf16)
      c.fail("option 'rotation_matrix': dtype " + std::string(to_string(opt.rotation_matrix.dtype)) +
             " with matrix_precision 'bf16', expected bf16 (round R to bf16 first, or use 'exact')");
    if (x.dtype != DType::bf16)
      c.fail("argument 'x': dtype " + std::string(to_string(x.dtype)) +
             " with matrix_precision 'bf16', expected bf16 (the tensor cores' operands; use 'exact' for other dtypes)");
  }
}

// dequantize rotates back: a matrix rotation needs its inverse there.
void check_rotation_inverse(const Checker& c, const QuantOptions& opt) {
  if (opt.rotation == Rotation::matrix && !opt.rotation_inverse.data)
    c.fail("option 'rotation_inverse': missing; dequantize with rotation 'matrix' rotates back by R^-1 (R^T for an "
           "orthogonal R)");
}

// Rotation::matrix: the matrix the op reads is one of its inputs for the overlap check (a matrix sharing
// memory with an output would be read while the GPU writes it).
void record_matrix(Checker& c, const QuantOptions& opt, bool inverse) {
  const Tensor& m = inverse ? opt.rotation_inverse : opt.rotation_matrix;
  if (opt.rotation == Rotation::matrix && m.data) c.record(inverse ? "rotation_inverse" : "rotation_matrix", m, false);
}

// The input the backend quantizes: x itself, or (a rotation on a CPU backend) x rotated into buf
// (fp32). The CUDA backend rotates in its kernels.
// An fp32 scratch buffer for the CPU rotation paths, not zero-filled (every element is written before
// it is read): a zeroed std::vector cost one more pass over the tensor.
using Scratch = std::unique_ptr<float[]>;

Tensor rotated_input(const Checker& c, const Problem& p, const Tensor& x, Backend b, Scratch& buf) {
  if (p.opt.rotation == Rotation::none) return x;
  check_rotation_matrix(c, p.opt, x);
  check_rotation_on_cuda(c, p, b, false);
  if (p.empty || b == Backend::cuda) return x;
  buf.reset(new float[std::size_t(p.rows * p.K)]);
  cpu::rotate_rows(x, buf.get(), p.opt, false);
  return Tensor::of(buf.get(), DType::f32, p.rows, p.K);
}

// qdq in place on a CPU backend (y is both input and output).
void qdq_in_place(Backend b, const Problem& p, const Tensor& y) {
  if (b == Backend::reference) ref::qdq(p, y, y);
  else cpu::qdq(p, y, y);
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
  record_matrix(c, opt, false);
  c.no_overlap();
  const Backend b = choose("quantize", &opt, x,
                           {{"x", x.data}, {"codes", out.codes.data}, {"scales", out.scales.data},
                            {"clip_mask", out.clip_mask.data}, {"tensor_scale", out.tensor_scale}, {"workspace", opt.workspace}},
                           opt.backend);
  Scratch rot;
  const Tensor xin = rotated_input(c, p, x, b, rot);
  plan_tensor_scale(c, p, xin, b, out.tensor_scale);
#if defined(MXQ_HAVE_CUDA)
  if (b == Backend::cuda) return p.empty ? cuda::write_empty(p, out) : cuda::quantize(p, x, out);
#endif
  if (!p.empty) {
    if (b == Backend::reference)
      ref::quantize(p, xin, out);
    else
      cpu::quantize(p, xin, out);
  } else if (opt.scale_layout == ScaleLayout::swizzled && ss.rows * ss.cols > 0) {
    std::memset(out.scales.data, 0, ss.rows * ss.cols);
  }
  if (out.tensor_scale) *out.tensor_scale = p.S;
}

void dequantize(const QuantizedIn& q, const Tensor& y, const QuantOptions& opt) {
  Checker c("dequantize");
  c.float_view("y", y);
  const Problem p = core::make_problem(c, opt, y.rows, y.cols);
  if (opt.format == Format::nvfp4 && !opt.tensor_scale && opt.rule != ScaleRule::quest)
    c.fail("option 'tensor_scale': dequantizing nvfp4 needs the encode scale S that quantize used (rule 'quest': 1)");
  c.view("codes", q.codes, DType::u8, y.rows, code_cols(opt.format, y.cols));
  const Shape2 ss = scale_shape(opt, y.rows, y.cols);
  c.view("scales", q.scales, DType::u8, ss.rows, ss.cols, opt.scale_layout == ScaleLayout::swizzled);
  c.same_device("codes", q.codes, y.device);
  c.same_device("scales", q.scales, y.device);
  c.record("codes", q.codes, false);
  c.record("scales", q.scales, false);
  c.record("y", y, true);
  record_matrix(c, opt, true);
  c.no_overlap();
  const Backend b = choose("dequantize", &opt, y, {{"codes", q.codes.data}, {"scales", q.scales.data}, {"y", y.data}}, opt.backend);
  if (opt.rotation != Rotation::none) {  // dequantize into fp32, un-rotate, round to y's dtype
    check_rotation_on_cuda(c, p, b, true);
    check_rotation_inverse(c, opt);
    if (p.empty) return;
#if defined(MXQ_HAVE_CUDA)
    if (b == Backend::cuda) return cuda::dequantize(p, q, y);
#endif
    const Scratch buf(new float[std::size_t(p.rows * p.K)]);
    const Tensor t = Tensor::of(buf.get(), DType::f32, p.rows, p.K);
    if (b == Backend::reference) ref::dequantize(p, q, t);
    else cpu::dequantize(p, q, t);
    cpu::rotate_rows(t, buf.get(), opt, true);
    cpu::store_rows(buf.get(), y);
    return;
  }
  if (p.empty) return;
#if defined(MXQ_HAVE_CUDA)
  if (b == Backend::cuda) return cuda::dequantize(p, q, y);
#endif
  if (b == Backend::reference)
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
  // the matrix is an input like x: it must not overlap y, in place or not
  if (!in_place) c.record("x", x, false);
  c.record("y", y, true);
  record_matrix(c, opt, false);
  c.no_overlap();
  const Backend b = choose("qdq", &opt, x, {{"x", x.data}, {"y", y.data}, {"workspace", opt.workspace}}, opt.backend);
  if (opt.rotation != Rotation::none) {  // QDQ of the rotated fp32 tensor (exact in fp32), rounded to y's dtype
    Scratch rot;
    const Tensor t = rotated_input(c, p, x, b, rot);
    if (b == Backend::cuda) {  // rotated in the kernels (and the NVFP4 tensor amax of the rotated x)
      plan_tensor_scale(c, p, x, b, nullptr);
      if (p.empty) return;
#if defined(MXQ_HAVE_CUDA)
      return cuda::qdq(p, x, y);
#endif
    }
    if (p.empty) return;
    plan_tensor_scale(c, p, t, b, nullptr);
    qdq_in_place(b, p, t);
    cpu::store_rows(rot.get(), y);
    return;
  }
  plan_tensor_scale(c, p, x, b, nullptr);
  if (p.empty) return;
#if defined(MXQ_HAVE_CUDA)
  if (b == Backend::cuda) return cuda::qdq(p, x, y);
#endif
  if (b == Backend::reference)
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
  return choose(fn, nullptr, linear, {{"linear", linear.data}, {"swizzled", swizzled.data}}, backend);
}

}  // namespace

void swizzle_scales(const Tensor& linear, const Tensor& swizzled, Backend backend, void* stream) {
  const Backend b = check_scale_pair("swizzle_scales", linear, swizzled, true, backend);
  if (swizzled.rows * swizzled.cols == 0) return;
#if defined(MXQ_HAVE_CUDA)
  if (b == Backend::cuda) return cuda::swizzle_scales(linear, swizzled, stream);
#else
  (void)stream;
#endif
  if (b == Backend::reference)
    ref::swizzle_scales(linear, swizzled);
  else
    cpu::swizzle_scales(linear, swizzled);
}

void unswizzle_scales(const Tensor& swizzled, const Tensor& linear, Backend backend, void* stream) {
  const Backend b = check_scale_pair("unswizzle_scales", linear, swizzled, false, backend);
  if (linear.rows * linear.cols == 0) return;
#if defined(MXQ_HAVE_CUDA)
  if (b == Backend::cuda) return cuda::unswizzle_scales(swizzled, linear, stream);
#else
  (void)stream;
#endif
  if (b == Backend::reference)
    ref::unswizzle_scales(swizzled, linear);
  else
    cpu::unswizzle_scales(swizzled, linear);
}

float tensor_amax(const Tensor& x, Backend backend, void* stream) {
  Checker c("tensor_amax");
  c.float_view("x", x);
  const Backend b = choose("tensor_amax", nullptr, x, {{"x", x.data}}, backend);
  if (x.rows == 0 || x.cols == 0) return 0.0f;
#if defined(MXQ_HAVE_CUDA)
  if (b == Backend::cuda) return cuda::tensor_amax(x, stream);
#else
  (void)stream;
#endif
  return b == Backend::reference ? ref::tensor_amax(x) : cpu::tensor_amax(x);
}

float tensor_amax(const Tensor& x, const QuantOptions& opt) {
  if (opt.rotation == Rotation::none) return tensor_amax(x, opt.backend, opt.stream);
  Checker c("tensor_amax");
  c.float_view("x", x);
  const Problem p = core::make_problem(c, opt, x.rows, x.cols);
  check_rotation_matrix(c, opt, x);
  const Backend b = choose("tensor_amax", &opt, x, {{"x", x.data}}, opt.backend);
  check_rotation_on_cuda(c, p, b, false);
  if (b == Backend::cuda)
    c.unsupported("tensor_amax with option 'rotation' on the CUDA backend: the CPU backends only in this version");
  if (p.empty) return 0.0f;
  return cpu::rotated_amax(x, opt);  // a max is exact: the same value on either CPU backend
}

namespace {
// The QDQ half of a fused producer op: checked like qdq's options, with the fused ops' limits.
std::optional<Problem> fused_problem(const Checker& c, const QuantOptions* q, const Tensor& y, Backend backend,
                                     void* stream) {
  if (!q) return std::nullopt;
  Problem p = core::make_problem(c, *q, y.rows, y.cols);
  if (q->rotation != Rotation::none)
    c.unsupported("option 'rotation': the fused producer ops do not rotate (produce the tensor, then qdq())");
  if (p.stochastic)
    c.unsupported("option 'rounding': the fused producer ops round to nearest even only (stochastic rounding: "
                  "produce the tensor, then qdq())");
  if (p.opt.format == Format::nvfp4_e5m3)
    c.unsupported("format 'nvfp4_e5m3' in the fused producer ops (produce the tensor, then qdq())");
  if (p.nvfp4_quest())
    c.unsupported("nvfp4 with rule 'quest' in the fused producer ops (produce the tensor, then qdq())");
  if (p.nvfp4() && !q->tensor_scale)
    c.unsupported("nvfp4 needs option 'tensor_scale' in the fused producer ops (a computed tensor scale needs the "
                  "whole output before any block: produce the tensor, then qdq())");
  if (q->backend != Backend::automatic && q->backend != backend)
    c.fail("option 'backend' of 'qdq' differs from argument 'backend'; set one of them");
  if (q->stream && q->stream != stream) c.fail("option 'stream' of 'qdq' differs from argument 'stream'; set one of them");
  return p;
}

void check_eps(const Checker& c, float eps) {
  if (!(eps >= 0.0f) || !core::is_finite_bits(core::f2u(eps)))
    c.fail("argument 'eps': " + std::to_string(eps) + ", expected a finite value >= 0");
}

void check_cols(const Checker& c, const Tensor& x) {
  if (x.cols >= (std::int64_t(1) << 24))
    c.fail("argument 'x': " + std::to_string(x.cols) + " columns, expected fewer than 2^24");
}

}  // namespace

void rms_norm(const Tensor& x, const Tensor& weight, float eps, const Tensor& y, const QuantOptions* qdq_opt,
              Backend backend, void* stream) {
  Checker c("rms_norm");
  c.float_view("x", x);
  c.view("weight", weight, x.dtype, 1, x.cols);
  c.view("y", y, x.dtype, x.rows, x.cols);
  c.same_device("weight", weight, x.device);
  c.same_device("y", y, x.device);
  check_eps(c, eps);
  check_cols(c, x);
  const std::optional<Problem> p = fused_problem(c, qdq_opt, y, backend, stream);
  const bool in_place = y.data == x.data && y.stride() == x.stride();
  if (!in_place) c.record("x", x, false);
  c.record("weight", weight, false);
  c.record("y", y, true);
  c.no_overlap();
  const Backend b = choose("rms_norm", qdq_opt, x, {{"x", x.data}, {"weight", weight.data}, {"y", y.data}}, backend);
  if (x.rows == 0 || x.cols == 0) return;
#if defined(MXQ_HAVE_CUDA)
  if (b == Backend::cuda) return cuda::rms_norm(x, weight, eps, y, p ? &*p : nullptr, stream);
#endif
  cpu::rms_norm(x, weight, eps, y);
  if (p) qdq_in_place(b, *p, y);
}

void silu_mul(const Tensor& gate, const Tensor& up, const Tensor& y, const QuantOptions* qdq_opt, Backend backend,
              void* stream) {
  Checker c("silu_mul");
  c.float_view("gate", gate);
  c.view("up", up, gate.dtype, gate.rows, gate.cols);
  c.view("y", y, gate.dtype, gate.rows, gate.cols);
  c.same_device("up", up, gate.device);
  c.same_device("y", y, gate.device);
  const std::optional<Problem> p = fused_problem(c, qdq_opt, y, backend, stream);
  const bool alias_gate = y.data == gate.data && y.stride() == gate.stride();
  const bool alias_up = y.data == up.data && y.stride() == up.stride();
  if (!alias_gate) c.record("gate", gate, false);
  if (!alias_up) c.record("up", up, false);
  c.record("y", y, true);
  c.no_overlap();
  const Backend b = choose("silu_mul", qdq_opt, gate, {{"gate", gate.data}, {"up", up.data}, {"y", y.data}}, backend);
  if (gate.rows == 0 || gate.cols == 0) return;
#if defined(MXQ_HAVE_CUDA)
  if (b == Backend::cuda) return cuda::silu_mul(gate, up, y, p ? &*p : nullptr, stream);
#endif
  cpu::silu_mul(gate, up, y);
  if (p) qdq_in_place(b, *p, y);
}

}  // namespace mxq
