// mxq's operations as torch.library custom ops (namespace "mxq"): one C++ kernel per op, registered
// for CPU and CUDA; their fake (meta) implementations are registered from Python
// (python/mxq/_meta.py). The quantization ops' options are declared once ("the options" below). Every
// op allocates its outputs through ATen (the caching allocator on CUDA), runs on the current CUDA
// stream and never synchronises, so it can be captured in a CUDA graph.
//
// Tensors of any rank are flattened to rows of the last dimension. A tensor whose last stride is 1 and
// whose leading dimensions collapse to one row stride is passed as a strided 2-D view; anything else is
// copied to a contiguous tensor first (an in-place target is then written back with copy_).
//
// Only the public C++ API is used (include/mxq/ops.hpp, include/mxq/types.hpp). mxq::Error becomes a
// Python ValueError (invalid_argument), NotImplementedError (unsupported) or RuntimeError (the rest),
// carrying mxq's message, which names the function, the argument, what it got and what was expected.
#include <Python.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <optional>
#include <span>
#include <string>
#include <string_view>

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <ATen/core/stack.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/csrc/autograd/custom_function.h>
#include <torch/csrc/autograd/variable.h>
#include <torch/library.h>

#if defined(MXQ_TORCH_CUDA)
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#endif

#include <mxq/fp_env.hpp>
#include <mxq/linear.hpp>
#include <mxq/moe.hpp>
#include <mxq/ops.hpp>
#include <mxq/types.hpp>

#if defined(MXQ_TORCH_CUDA)
namespace mxq_torch {
// python/csrc/hadamard_rotate.cu (compiled into this extension when it is built with CUDA)
cudaError_t hadamard_rotate_f64_cuda(const void* a, int dtype, float* y, int64_t groups, int rs, double c,
                                     cudaStream_t stream);
}  // namespace mxq_torch
#endif

namespace mxq_torch {
namespace {

// ---- errors ---------------------------------------------------------------------------------------
[[noreturn]] void rethrow(const mxq::Error& e) {
  switch (e.code()) {
    case mxq::Error::Code::invalid_argument: TORCH_CHECK_VALUE(false, e.what());
    case mxq::Error::Code::unsupported: TORCH_CHECK_NOT_IMPLEMENTED(false, e.what());
    default: TORCH_CHECK(false, e.what());
  }
  throw;  // not reached: every branch above throws
}

template <class F>
auto guarded(F&& f) {
  try {
    return f();
  } catch (const mxq::Error& e) {
    rethrow(e);
  }
}

std::string shape_str(const at::Tensor& t);
std::string device_name(const at::Tensor& t);

// ---- the options, declared once -------------------------------------------------------------------
// The arguments the quantization ops take after their tensors (format, rule, group_size, ...,
// matrix_precision) are each declared once below: name, schema type, schema default, and what the
// argument sets in mxq::QuantOptions with the checks the library does not make itself. Each op lists the
// options it carries (OpSpec), in schema order. From these lists come the schemas (TORCH_LIBRARY at the
// end), the kernels' reading of their arguments (Args, quant_options), and the autograd kernels'
// pass-through, which hands the arguments on as the dispatcher gave them (the kernels are boxed, so no
// argument list is written out anywhere else). The fake implementations (python/mxq/_meta.py) bind the
// registered schemas' names. Adding an option: CONTRIBUTING.md.

// What an option sets: the options of one call of `op` on the data tensor `data` (a rotation matrix
// must be on its device); `held` keeps alive the contiguous copy of a matrix that a view in `o` points
// into.
struct Setting {
  const char* op;
  const at::Tensor& data;
  mxq::QuantOptions o{};
  at::Tensor held{};
};

struct Option {
  const char* name;
  const char* type;      // as the schema writes it
  const char* fallback;  // the schema's default, "" for none (a new option goes last, with a default)
  void (*set)(Setting&, const c10::IValue&);  // nullptr: the op's kernel reads the argument itself
};

// A rotation matrix given as a tensor (rotation_matrix of quantize and qdq: R; rotation_inverse of
// dequantize: R^-1): Rotation::matrix of its size, with the C++ API's view of it on the data's device
// (host memory for CPU tensors, the same GPU for CUDA tensors), held alive by s.held (a contiguous copy
// where it was not).
void set_matrix(Setting& s, const c10::IValue& v, bool inverse) {
  if (v.isNone()) return;
  const at::Tensor& m = v.toTensor();
  const at::Tensor& like = s.data;
  const char* op = s.op;
  const char* arg = inverse ? "rotation_inverse" : "rotation_matrix";
  TORCH_CHECK_VALUE(s.o.rotation == mxq::Rotation::none, "mxq.", op, ": argument '", arg, "' given with rotation '",
                    std::string(mxq::to_string(s.o.rotation)), "': pass either a rotation name or a matrix");
  TORCH_CHECK_VALUE(m.dim() == 2 && m.size(0) == m.size(1), "mxq.", op, ": argument '", arg, "': shape ", shape_str(m),
                    ", expected a square [RS, RS] matrix");
  const int64_t rs = m.size(0);
  TORCH_CHECK_VALUE(rs >= 16 && rs <= 256 && (rs & (rs - 1)) == 0, "mxq.", op, ": argument '", arg, "': shape ", shape_str(m),
                    ", expected RS = 16, 32, 64, 128 or 256");
  TORCH_CHECK_VALUE(m.scalar_type() == at::kFloat || m.scalar_type() == at::kBFloat16, "mxq.", op, ": argument '", arg,
                    "': dtype ", m.scalar_type(), ", expected float32 or bfloat16");
  TORCH_CHECK_VALUE(m.device() == like.device(), "mxq.", op, ": argument '", arg, "' is on ", device_name(m),
                    ", expected the data's device ", device_name(like));
  s.held = m.contiguous();
  s.o.rotation = mxq::Rotation::matrix;
  s.o.rotation_size = static_cast<int>(rs);
  (inverse ? s.o.rotation_inverse : s.o.rotation_matrix) =
      mxq::Tensor{s.held.data_ptr(), m.scalar_type() == at::kFloat ? mxq::DType::f32 : mxq::DType::bf16, rs, rs, 0,
                  like.is_cuda() ? mxq::Device::cuda : mxq::Device::cpu};
}

// NOTE: the setters are captureless lambdas, so that each option reads as one entry; the order of a
// list is the order they run in (a rule after its format, a matrix after the rotation name).
constexpr Option kFormat{"format", "str", "", [](Setting& s, const c10::IValue& v) {
  guarded([&] {
    s.o.format = mxq::parse_format(v.toStringView());
    return 0;
  });
  s.o.rule = s.o.format == mxq::Format::nvfp4        ? mxq::ScaleRule::nvfp4  // the default rule
             : s.o.format == mxq::Format::nvfp4_e5m3 ? mxq::ScaleRule::nvfp4_e5m3
                                                     : mxq::ScaleRule::floor;
}};
// The fused producers' format: None for no QDQ of the output (their kernels check that first).
constexpr Option kFormatOrNone{"format", "str?", "", kFormat.set};
constexpr Option kRule{"rule", "str", "", [](Setting& s, const c10::IValue& v) {
  const std::string_view r = v.toStringView();  // "": the format's default
  if (!r.empty()) guarded([&] {
    s.o.rule = mxq::parse_rule(r);
    return 0;
  });
}};
constexpr Option kGroupSize{"group_size", "int", "", [](Setting& s, const c10::IValue& v) {
  const int64_t g = v.toInt();  // the library checks for a power of two; the bound keeps the int cast exact
  TORCH_CHECK_VALUE(g >= 0 && g <= (1 << 16), "mxq.", s.op, ": argument 'group_size': ", std::to_string(g),
                    ", expected 0 (the format's default) or a power of two in [2, 256]");
  s.o.group_size = static_cast<int>(g);
}};
constexpr Option kStochastic{"stochastic", "bool", "", [](Setting& s, const c10::IValue& v) {
  s.o.rounding = v.toBool() ? mxq::Rounding::stochastic : mxq::Rounding::nearest_even;
}};
// NOTE: the schema's int is int64; the 64-bit patterns of the uint64 seeds and offset pass through.
constexpr Option kSeed{"seed", "int", "", [](Setting& s, const c10::IValue& v) {
  s.o.seed = static_cast<std::uint64_t>(v.toInt());
}};
constexpr Option kOffset{"offset", "int", "", [](Setting& s, const c10::IValue& v) {
  s.o.offset = static_cast<std::uint64_t>(v.toInt());
}};
// The scale layout: "linear" ([..., G] like the data's leading dims), "swizzled" (the 128x4 layout,
// 2-D) or "padded" (the linear layout in a zero-padded [ceil(rows/128)*128, ceil(G/4)*4] buffer:
// QuTLASS's output), which the kernels handle themselves.
constexpr Option kLayout{"layout", "str", "", [](Setting& s, const c10::IValue& v) {
  const std::string_view l = v.toStringView();
  TORCH_CHECK_VALUE(l == "linear" || l == "swizzled" || l == "padded", "mxq.", s.op, ": argument 'layout': '",
                    std::string(l), "', expected one of: linear, swizzled, padded");
  s.o.scale_layout = l == "swizzled" ? mxq::ScaleLayout::swizzled : mxq::ScaleLayout::linear;
}};
constexpr Option kTensorScale{"tensor_scale", "float?", "", [](Setting& s, const c10::IValue& v) {
  if (!v.isNone()) s.o.tensor_scale = static_cast<float>(v.toDouble());
}};
// dequantize's tensor scale as a tensor (quantize's output) instead of a float.
constexpr Option kTensorScaleTensor{"tensor_scale_tensor", "Tensor?", "", [](Setting& s, const c10::IValue& v) {
  if (v.isNone()) return;
  TORCH_CHECK_VALUE(!s.o.tensor_scale, "mxq.", s.op, ": pass the tensor scale either as a float or as a tensor, not both");
  const at::Tensor& t = v.toTensor();
  TORCH_CHECK_VALUE(t.numel() == 1 && t.scalar_type() == at::kFloat, "mxq.", s.op,
                    ": argument 'tensor_scale': expected a float32 tensor of one element, got ", t.scalar_type(),
                    " of shape ", shape_str(t));
  // NOTE: the C++ API takes the encode scale as a host float, so a device tensor is read back here
  // (a synchronisation). See docs/python.md, "Limits".
  s.o.tensor_scale = t.item<float>();
}};
constexpr Option kClipMask{"clip_mask", "bool", "", nullptr};  // quantize: also write the 1-bit clip mask
constexpr Option kDtype{"dtype", "ScalarType", "", nullptr};   // dequantize: the output's dtype
// Stochastic rounding's random bits per element: 32, 16 or 8.
constexpr Option kRandomBits{"random_bits", "int", "32", [](Setting& s, const c10::IValue& v) {
  const int64_t b = v.toInt();
  TORCH_CHECK_VALUE(b == 32 || b == 16 || b == 8, "mxq: argument 'random_bits': ", std::to_string(b),
                    ", expected 32, 16 or 8");
  s.o.random_bits = static_cast<int>(b);
}};
// "none", "had<RS>" or "rhad<RS>"; a matrix comes as rotation_matrix / rotation_inverse.
constexpr Option kRotation{"rotation", "str", "\"none\"", [](Setting& s, const c10::IValue& v) {
  guarded([&] {
    const auto [r, rs] = mxq::parse_rotation(v.toStringView());
    s.o.rotation = r;
    s.o.rotation_size = rs;
    return 0;
  });
}};
constexpr Option kRotationSeed{"rotation_seed", "int", "0", [](Setting& s, const c10::IValue& v) {
  s.o.rotation_seed = static_cast<std::uint64_t>(v.toInt());
}};
constexpr Option kRotationMatrix{"rotation_matrix", "Tensor?", "None",
                                 [](Setting& s, const c10::IValue& v) { set_matrix(s, v, false); }};
constexpr Option kRotationInverse{"rotation_inverse", "Tensor?", "None",
                                  [](Setting& s, const c10::IValue& v) { set_matrix(s, v, true); }};
// How a rotation matrix is summed: "exact" or "bf16" (docs/numerics.md; the library checks the rest: a
// matrix rotation, bf16 x and R, RS <= 128).
constexpr Option kMatrixPrecision{"matrix_precision", "str", "\"exact\"", [](Setting& s, const c10::IValue& v) {
  const std::string_view p = v.toStringView();
  if (p == "exact") s.o.matrix_precision = mxq::MatrixPrecision::exact;
  else if (p == "bf16") s.o.matrix_precision = mxq::MatrixPrecision::bf16;
  else TORCH_CHECK_VALUE(false, "mxq.", s.op, ": argument 'matrix_precision': '", std::string(p), "', expected 'exact' or 'bf16'");
}};

// The options of each op, in schema order. qdq and qdq_ share theirs: the straight-through gradient of
// qdq_ calls qdq with them.
constexpr const Option* kQdqOptions[] = {&kFormat, &kRule, &kGroupSize, &kStochastic, &kSeed, &kOffset, &kTensorScale,
                                         &kRandomBits, &kRotation, &kRotationSeed, &kRotationMatrix, &kMatrixPrecision};
constexpr const Option* kQuantizeOptions[] = {&kFormat, &kRule, &kGroupSize, &kStochastic, &kSeed, &kOffset, &kLayout,
                                              &kTensorScale, &kClipMask, &kRandomBits, &kRotation, &kRotationSeed,
                                              &kRotationMatrix, &kMatrixPrecision};
constexpr const Option* kDequantizeOptions[] = {&kFormat, &kGroupSize, &kLayout, &kTensorScale, &kTensorScaleTensor,
                                                &kDtype, &kRotation, &kRotationSeed, &kRotationInverse};
constexpr const Option* kFusedOptions[] = {&kFormatOrNone, &kRule, &kGroupSize, &kTensorScale};

struct OpSpec {
  const char* name;
  std::string_view inputs;  // the arguments before the options, as the schema writes them
  std::span<const Option* const> options;
  const char* returns;
  size_t input_count;  // of `inputs`
  size_t size;         // every argument

  constexpr OpSpec(const char* name, std::string_view inputs, std::span<const Option* const> options, const char* returns)
      : name(name), inputs(inputs), options(options), returns(returns),
        input_count(1 + std::count(inputs.begin(), inputs.end(), ',')), size(input_count + options.size()) {}
  std::string schema() const {
    std::string s = std::string(name) + "(" + std::string(inputs);
    for (const Option* o : options) s += std::string(", ") + o->type + " " + o->name + (*o->fallback ? "=" : "") + o->fallback;
    return s + ") -> " + returns;
  }
};

constexpr OpSpec kQdq{"qdq", "Tensor x", kQdqOptions, "Tensor"};
constexpr OpSpec kQdqInplace{"qdq_", "Tensor(a!) x", kQdqOptions, "()"};
constexpr OpSpec kQuantize{"quantize", "Tensor x", kQuantizeOptions,
                           "(Tensor codes, Tensor scales, Tensor tensor_scale, Tensor clip_mask)"};
constexpr OpSpec kDequantize{"dequantize", "Tensor codes, Tensor scales, SymInt cols", kDequantizeOptions, "Tensor"};
constexpr OpSpec kRmsNorm{"rms_norm", "Tensor x, Tensor weight, float eps", kFusedOptions, "Tensor"};
constexpr OpSpec kSiluMul{"silu_mul", "Tensor gate, Tensor up", kFusedOptions, "Tensor"};
constexpr const OpSpec* kOpSpecs[] = {&kQdq, &kQdqInplace, &kQuantize, &kDequantize, &kRmsNorm, &kSiluMul};

// One call's arguments as a boxed kernel receives them: the op's inputs, then its options, on the top
// of the stack (every argument is there: the dispatcher fills in the schema's defaults).
class Args {
 public:
  Args(const OpSpec& op, const torch::jit::Stack& stack) : op_(op) {
    TORCH_INTERNAL_ASSERT(stack.size() >= op.size, "mxq.", op.name, ": ", std::to_string(stack.size()),
                          " arguments on the stack, expected ", std::to_string(op.size));
    at_ = stack.data() + (stack.size() - op.size);
  }
  const OpSpec& op() const { return op_; }
  const c10::IValue& input(size_t i) const { return at_[i]; }
  const c10::IValue& option(size_t i) const { return at_[op_.input_count + i]; }
  const c10::IValue& operator[](const Option& o) const {
    const auto it = std::find(op_.options.begin(), op_.options.end(), &o);
    TORCH_INTERNAL_ASSERT(it != op_.options.end(), "mxq.", op_.name, " has no option '", o.name, "'");
    return option(static_cast<size_t>(it - op_.options.begin()));
  }
  // The options' values, in order: what the straight-through gradient hands to qdq.
  torch::jit::Stack options() const { return torch::jit::Stack(at_ + op_.input_count, at_ + op_.size); }
  // Replaces the arguments with the op's outputs.
  template <class... T>
  void ret(torch::jit::Stack& stack, T&&... outputs) const {
    torch::jit::drop(stack, op_.size);
    (stack.emplace_back(std::forward<T>(outputs)), ...);
  }

 private:
  const OpSpec& op_;
  const c10::IValue* at_ = nullptr;
};

// The call's options applied to QuantOptions in schema order; `held` keeps alive what a view in the
// result points into (a rotation matrix's contiguous copy).
mxq::QuantOptions quant_options(const Args& a, const at::Tensor& data, at::Tensor& held) {
  Setting s{a.op().name, data};
  for (size_t i = 0; i < a.op().options.size(); ++i)
    if (const auto set = a.op().options[i]->set) set(s, a.option(i));
  held = std::move(s.held);
  return s.o;
}

// ---- views ----------------------------------------------------------------------------------------
mxq::DType dtype_of(const at::Tensor& t, const char* op, const char* arg, bool u8) {
  switch (t.scalar_type()) {
    case at::kFloat: if (!u8) return mxq::DType::f32; break;
    case at::kHalf: if (!u8) return mxq::DType::f16; break;
    case at::kBFloat16: if (!u8) return mxq::DType::bf16; break;
    case at::kByte: if (u8) return mxq::DType::u8; break;
    default: break;
  }
  TORCH_CHECK_VALUE(false, "mxq.", op, ": argument '", arg, "': dtype ", t.scalar_type(), ", expected ",
                    u8 ? "uint8" : "float32, float16 or bfloat16");
  return mxq::DType::u8;  // not reached
}

// A tensor seen as `rows` rows of its last dimension `cols`, rows `row_stride` elements apart.
struct Rows {
  at::Tensor t;  // what `view` points into (the input itself, or a contiguous copy)
  int64_t rows = 0, cols = 0, row_stride = 0;
  bool copied = false;
};

// The row stride with which the leading dimensions of t collapse into one, if they do (the last
// dimension must have stride 1 and rows must not overlap).
std::optional<int64_t> collapsed_row_stride(const at::Tensor& t) {
  const int64_t n = t.dim();
  const int64_t K = t.size(n - 1);
  if (t.numel() == 0) return 0;  // nothing is addressed: dense
  if (K > 1 && t.stride(n - 1) != 1) return std::nullopt;
  std::optional<int64_t> rs;      // stride of the innermost leading dimension of size > 1
  int64_t expect = -1;            // the stride the next outer leading dimension must have
  for (int64_t d = n - 2; d >= 0; --d) {
    if (t.size(d) == 1) continue;
    if (!rs) {
      rs = t.stride(d);
    } else if (t.stride(d) != expect) {
      return std::nullopt;
    }
    expect = t.stride(d) * t.size(d);
  }
  if (!rs) return K;  // at most one row
  if (*rs < K) return std::nullopt;
  return rs;
}

Rows as_rows(const at::Tensor& t, const char* op, const char* arg) {
  TORCH_CHECK_VALUE(t.dim() >= 1, "mxq.", op, ": argument '", arg,
                    "': a 0-dimensional tensor, expected at least 1 dimension (rows x K)");
  Rows r;
  r.cols = t.size(-1);
  r.rows = 1;
  for (int64_t d = 0; d + 1 < t.dim(); ++d) r.rows *= t.size(d);
  if (auto rs = collapsed_row_stride(t)) {
    r.t = t;
    r.row_stride = *rs;
  } else {
    r.t = t.contiguous();
    r.row_stride = r.cols;
    r.copied = true;
  }
  return r;
}

// Shapes and devices in messages as plain strings; every number in a TORCH_CHECK message goes through
// std::to_string.
// NOTE: measured on an H200 (torch 2.11+cu130, 2026-12-04): a failing TORCH_CHECK whose message
// streams an integer (an int64_t, an IntArrayRef) crashed the process (segmentation fault), for the old
// ops (qdq's group_size) as for the new; messages of strings and dtypes raised normally, and the CPU-only
// torch 2.11 and 2.15 wheels raise in every case. Integer formatting through c10::str's ostream is the
// common factor; std::to_string does not use it.
std::string shape_str(const at::Tensor& t) {
  std::string s = "[";
  for (int64_t d = 0; d < t.dim(); ++d) s += (d ? ", " : "") + std::to_string(t.size(d));
  return s + "]";
}
std::string device_name(const at::Tensor& t) { return t.device().str(); }

mxq::Device mxq_device(const at::Tensor& t) { return t.is_cuda() ? mxq::Device::cuda : mxq::Device::cpu; }

mxq::Tensor view(const Rows& r, mxq::DType dt) {
  return mxq::Tensor{r.t.data_ptr(), dt, r.rows, r.cols, r.row_stride, mxq_device(r.t)};
}

// A dense 2-D view of a freshly allocated contiguous tensor, flattened to rows x last dim.
mxq::Tensor dense_view(const at::Tensor& t, mxq::DType dt) {
  const int64_t cols = t.dim() ? t.size(-1) : 1;
  const int64_t rows = cols ? t.numel() / cols : 0;
  return mxq::Tensor{t.data_ptr(), dt, t.dim() ? rows : 1, cols, 0, mxq_device(t)};
}

// The current stream of t's device (CUDA), and a guard making that device current.
struct DeviceContext {
#if defined(MXQ_TORCH_CUDA)
  c10::cuda::OptionalCUDAGuard guard;
#endif
  void* stream = nullptr;
  explicit DeviceContext(const at::Tensor& t) {
#if defined(MXQ_TORCH_CUDA)
    if (t.is_cuda()) {
      guard.set_device(t.device());
      stream = static_cast<void*>(c10::cuda::getCurrentCUDAStream(t.get_device()).stream());
    }
#else
    (void)t;
#endif
  }
};

std::vector<int64_t> with_last(at::IntArrayRef sizes, int64_t last) {
  std::vector<int64_t> s(sizes.begin(), sizes.end());
  s.back() = last;
  return s;
}

// ---- qdq ------------------------------------------------------------------------------------------
// The kernels of the ops with options are boxed: void(op, stack), reading their arguments through Args.
void qdq_into(const Rows& x, mxq::DType dt, const mxq::Tensor& y, mxq::QuantOptions& o, const at::Tensor& like) {
  DeviceContext ctx(like);
  o.stream = ctx.stream;
  at::Tensor workspace;
  if (like.is_cuda() && o.format == mxq::Format::nvfp4 && !o.tensor_scale) {
    workspace = at::empty({1}, like.options().dtype(at::kFloat));
    o.workspace = workspace.data_ptr();
  }
  guarded([&] {
    mxq::qdq(view(x, dt), y, o);
    return 0;
  });
}

void qdq(const c10::OperatorHandle&, torch::jit::Stack* stack) {
  const Args a(kQdq, *stack);
  const at::Tensor& x = a.input(0).toTensor();
  at::Tensor held;
  mxq::QuantOptions o = quant_options(a, x, held);
  const mxq::DType dt = dtype_of(x, "qdq", "x", false);
  const Rows xr = as_rows(x, "qdq", "x");
  at::Tensor y = at::empty(x.sizes(), x.options().memory_format(at::MemoryFormat::Contiguous));
  qdq_into(xr, dt, mxq::Tensor{y.data_ptr(), dt, xr.rows, xr.cols, 0, mxq_device(y)}, o, x);
  a.ret(*stack, std::move(y));
}

void qdq_(const c10::OperatorHandle&, torch::jit::Stack* stack) {
  const Args a(kQdqInplace, *stack);
  const at::Tensor& x = a.input(0).toTensor();
  at::Tensor held;
  mxq::QuantOptions o = quant_options(a, x, held);
  const mxq::DType dt = dtype_of(x, "qdq_", "x", false);
  const Rows xr = as_rows(x, "qdq_", "x");
  qdq_into(xr, dt, view(xr, dt), o, x);
  if (xr.copied) x.copy_(xr.t);
  a.ret(*stack);
}

// ---- fused producers: rms_norm, silu_mul (optionally with a QDQ of the output) ----------------------
std::optional<mxq::QuantOptions> fused_options(const Args& a, const at::Tensor& data) {
  if (a[kFormatOrNone].isNone()) {
    TORCH_CHECK_VALUE(a[kRule].toStringView().empty() && a[kGroupSize].toInt() == 0 && a[kTensorScale].isNone(),
                      "mxq.", a.op().name, ": 'rule', 'group_size' and 'tensor_scale' need a 'format' (the QDQ of the output)");
    return std::nullopt;
  }
  at::Tensor held;  // stays empty: the fused ops take no rotation matrix
  return quant_options(a, data, held);
}

void rms_norm(const c10::OperatorHandle&, torch::jit::Stack* stack) {
  const Args a(kRmsNorm, *stack);
  const at::Tensor& x = a.input(0).toTensor();
  const at::Tensor& weight = a.input(1).toTensor();
  const double eps = a.input(2).toDouble();
  std::optional<mxq::QuantOptions> o = fused_options(a, x);
  const mxq::DType dt = dtype_of(x, "rms_norm", "x", false);
  const Rows xr = as_rows(x, "rms_norm", "x");
  TORCH_CHECK_VALUE(weight.dim() == 1 && weight.size(0) == xr.cols, "mxq.rms_norm: argument 'weight': shape ",
                    shape_str(weight), ", expected [", std::to_string(xr.cols), "] (the last dimension of x)");
  TORCH_CHECK_VALUE(weight.scalar_type() == x.scalar_type(), "mxq.rms_norm: argument 'weight': dtype ",
                    weight.scalar_type(), ", expected x's dtype ", x.scalar_type());
  TORCH_CHECK_VALUE(weight.device() == x.device(), "mxq.rms_norm: argument 'weight' is on ", device_name(weight),
                    ", x on ", device_name(x));
  const at::Tensor w = weight.contiguous();
  at::Tensor y = at::empty(x.sizes(), x.options().memory_format(at::MemoryFormat::Contiguous));
  DeviceContext ctx(x);
  guarded([&] {
    mxq::rms_norm(view(xr, dt), mxq::Tensor{w.data_ptr(), dt, 1, xr.cols, 0, mxq_device(w)}, static_cast<float>(eps),
                  mxq::Tensor{y.data_ptr(), dt, xr.rows, xr.cols, 0, mxq_device(y)}, o ? &*o : nullptr,
                  mxq::Backend::automatic, ctx.stream);
    return 0;
  });
  a.ret(*stack, std::move(y));
}

void silu_mul(const c10::OperatorHandle&, torch::jit::Stack* stack) {
  const Args a(kSiluMul, *stack);
  const at::Tensor& gate = a.input(0).toTensor();
  const at::Tensor& up = a.input(1).toTensor();
  std::optional<mxq::QuantOptions> o = fused_options(a, gate);
  const mxq::DType dt = dtype_of(gate, "silu_mul", "gate", false);
  TORCH_CHECK_VALUE(up.sizes() == gate.sizes() && up.scalar_type() == gate.scalar_type() && up.device() == gate.device(),
                    "mxq.silu_mul: argument 'up': ", up.scalar_type(), " ", shape_str(up), " on ", device_name(up),
                    ", expected gate's ", gate.scalar_type(), " ", shape_str(gate), " on ", device_name(gate));
  const Rows gr = as_rows(gate, "silu_mul", "gate");
  const Rows ur = as_rows(up, "silu_mul", "up");
  at::Tensor y = at::empty(gate.sizes(), gate.options().memory_format(at::MemoryFormat::Contiguous));
  DeviceContext ctx(gate);
  guarded([&] {
    mxq::silu_mul(view(gr, dt), view(ur, dt), mxq::Tensor{y.data_ptr(), dt, gr.rows, gr.cols, 0, mxq_device(y)},
                  o ? &*o : nullptr, mxq::Backend::automatic, ctx.stream);
    return 0;
  });
  a.ret(*stack, std::move(y));
}

// ---- quantize -------------------------------------------------------------------------------------
void quantize(const c10::OperatorHandle&, torch::jit::Stack* stack) {
  const Args a(kQuantize, *stack);
  const at::Tensor& x = a.input(0).toTensor();
  at::Tensor held;
  mxq::QuantOptions o = quant_options(a, x, held);
  const std::string_view layout = a[kLayout].toStringView();
  const bool swizzled = layout == "swizzled", padded = layout == "padded", clip_mask = a[kClipMask].toBool();
  const mxq::DType dt = dtype_of(x, "quantize", "x", false);
  const Rows xr = as_rows(x, "quantize", "x");
  const auto u8 = x.options().dtype(at::kByte).memory_format(at::MemoryFormat::Contiguous);
  const int64_t K = xr.cols;
  mxq::Shape2 ss{};
  int64_t cc = 0;
  guarded([&] {
    cc = mxq::code_cols(o.format, K);
    ss = mxq::scale_shape(o, xr.rows, K);
    return 0;
  });
  at::Tensor codes = at::empty(with_last(x.sizes(), cc), u8);
  at::Tensor scales;
  int64_t scale_stride = 0;
  if (swizzled) {
    scales = at::empty({ss.rows, ss.cols}, u8);
  } else if (padded) {
    const int64_t pr = (xr.rows + 127) / 128 * 128, pc = (ss.cols + 3) / 4 * 4;
    scales = (pr == xr.rows && pc == ss.cols) ? at::empty({pr, pc}, u8) : at::zeros({pr, pc}, u8);
    scale_stride = pc;
  } else {
    scales = at::empty(with_last(x.sizes(), ss.cols), u8);
  }
  at::Tensor mask = clip_mask ? at::empty(with_last(x.sizes(), (K + 7) / 8), u8) : at::empty({0}, u8);
  const bool nv = o.format == mxq::Format::nvfp4;
  at::Tensor ts = at::empty({nv ? 1 : 0}, x.options().dtype(at::kFloat));
  DeviceContext ctx(x);
  o.stream = ctx.stream;
  mxq::QuantizedOut out;
  out.codes = mxq::Tensor{codes.data_ptr(), mxq::DType::u8, xr.rows, cc, 0, mxq_device(codes)};
  out.scales = mxq::Tensor{scales.data_ptr(), mxq::DType::u8, ss.rows, ss.cols, scale_stride, mxq_device(scales)};
  if (clip_mask) out.clip_mask = mxq::Tensor{mask.data_ptr(), mxq::DType::u8, xr.rows, (K + 7) / 8, 0, mxq_device(mask)};
  if (nv) out.tensor_scale = ts.data_ptr<float>();
  guarded([&] {
    mxq::quantize(view(xr, dt), out, o);
    return 0;
  });
  a.ret(*stack, std::move(codes), std::move(scales), std::move(ts), std::move(mask));
}

// ---- dequantize -----------------------------------------------------------------------------------
void dequantize(const c10::OperatorHandle&, torch::jit::Stack* stack) {
  const Args a(kDequantize, *stack);
  const at::Tensor& codes = a.input(0).toTensor();
  const at::Tensor& scales = a.input(1).toTensor();
  const int64_t cols = a.input(2).toSymInt().guard_int(__FILE__, __LINE__);
  at::Tensor held;
  mxq::QuantOptions o = quant_options(a, codes, held);
  const bool padded = a[kLayout].toStringView() == "padded";
  dtype_of(codes, "dequantize", "codes", true);
  dtype_of(scales, "dequantize", "scales", true);
  TORCH_CHECK_VALUE(cols >= 0, "mxq.dequantize: argument 'cols': ", std::to_string(cols), ", expected >= 0");
  const Rows cr = as_rows(codes, "dequantize", "codes");
  Rows sr = as_rows(scales, "dequantize", "scales");
  if (padded) {  // the linear scales are the top-left [rows, G] corner of the padded buffer
    mxq::Shape2 ss{};
    guarded([&] {
      ss = mxq::scale_shape(o, cr.rows, cols);
      return 0;
    });
    const int64_t pr = (cr.rows + 127) / 128 * 128, pc = (ss.cols + 3) / 4 * 4;
    TORCH_CHECK_VALUE(scales.dim() == 2 && scales.size(0) == pr && scales.size(1) == pc,
                      "mxq.dequantize: argument 'scales': shape ", shape_str(scales), ", expected [", std::to_string(pr), ", ",
                      std::to_string(pc), "] (layout 'padded': ", std::to_string(cr.rows), " rows padded to 128, ",
                      std::to_string(ss.cols),
                      " scale columns padded to 4)");
    sr.rows = ss.rows;
    sr.cols = ss.cols;
  }
  at::Tensor y = at::empty(with_last(codes.sizes(), cols), codes.options().dtype(a[kDtype].toScalarType()));
  const mxq::DType yt = dtype_of(y, "dequantize", "dtype", false);
  DeviceContext ctx(codes);
  o.stream = ctx.stream;
  guarded([&] {
    mxq::dequantize({view(cr, mxq::DType::u8), view(sr, mxq::DType::u8)},
                    mxq::Tensor{y.data_ptr(), yt, cr.rows, cols, 0, mxq_device(y)}, o);
    return 0;
  });
  a.ret(*stack, std::move(y));
}

// ---- scale layouts --------------------------------------------------------------------------------
at::Tensor swizzle_scales(const at::Tensor& linear) {
  dtype_of(linear, "swizzle_scales", "linear", true);
  TORCH_CHECK_VALUE(linear.dim() == 2, "mxq.swizzle_scales: argument 'linear': shape ", shape_str(linear),
                    ", expected 2 dimensions [rows, scale columns]");
  const Rows lr = as_rows(linear, "swizzle_scales", "linear");
  at::Tensor out = at::empty({(lr.rows + 127) / 128 * 128, (lr.cols + 3) / 4 * 4}, linear.options());
  DeviceContext ctx(linear);
  guarded([&] {
    mxq::swizzle_scales(view(lr, mxq::DType::u8), dense_view(out, mxq::DType::u8), mxq::Backend::automatic,
                        ctx.stream);
    return 0;
  });
  return out;
}

at::Tensor unswizzle_scales(const at::Tensor& swizzled, int64_t rows, int64_t cols) {
  dtype_of(swizzled, "unswizzle_scales", "swizzled", true);
  TORCH_CHECK_VALUE(swizzled.dim() == 2, "mxq.unswizzle_scales: argument 'swizzled': shape ", shape_str(swizzled),
                    ", expected 2 dimensions [rows padded to 128, scale columns padded to 4]");
  TORCH_CHECK_VALUE(rows >= 0 && cols >= 0, "mxq.unswizzle_scales: rows ", std::to_string(rows), " and cols ", std::to_string(cols),
                    " must be >= 0");
  const Rows sr = as_rows(swizzled, "unswizzle_scales", "swizzled");
  at::Tensor out = at::empty({rows, cols}, swizzled.options());
  DeviceContext ctx(swizzled);
  guarded([&] {
    mxq::unswizzle_scales(view(sr, mxq::DType::u8), mxq::Tensor{out.data_ptr(), mxq::DType::u8, rows, cols, 0,
                                                                mxq_device(out)},
                          mxq::Backend::automatic, ctx.stream);
    return 0;
  });
  return out;
}

// ---- hadamard_rotate_f64 --------------------------------------------------------------------------
// The QuTLASS shim's rotation by c * H (H the Sylvester Hadamard matrix, H[i][j] = (-1)^popcount(i & j))
// without a float64 matmul: each group of rs consecutive elements of `a` becomes
// y_j = RN32(RN64(c * S_j) + 0), S the float64 fast Walsh-Hadamard butterfly of the group (stages
// h = 1, 2, .., rs/2; each pair (lo, hi) -> (lo + hi, lo - hi) in double). The CPU loop below and the
// CUDA kernel (python/csrc/hadamard_rotate.cu) run the same operations in the same order: the same
// bits. Not in libmxq: an interim step before a rotation fused into the quantize kernels (issue 39).
// When it equals the float64 matmul `g.double() @ (c * H).double()`: docs/numerics.md.
void hadamard_groups_cpu(const at::Tensor& x, float* y, int64_t groups, int64_t rs, double c) {
  auto run = [&](auto load) {
    at::parallel_for(0, groups, 256, [&](int64_t g0, int64_t g1) {
      const mxq::IeeeSubnormalScope ieee;  // torch.set_flush_denormal(True) would change the bytes
      double v[256];
      for (int64_t g = g0; g < g1; ++g) {
        const int64_t base = g * rs;
        for (int64_t i = 0; i < rs; ++i) v[i] = load(base + i);
        for (int64_t h = 1; h < rs; h <<= 1)
          for (int64_t i = 0; i < rs; i += 2 * h)
            for (int64_t k = i; k < i + h; ++k) {
              const double lo = v[k], hi = v[k + h];
              v[k] = lo + hi;
              v[k + h] = lo - hi;
            }
        // + 0: a zero result is +0, as the matmul's sums starting from +0 give it
        for (int64_t i = 0; i < rs; ++i) y[base + i] = static_cast<float>(v[i] * c + 0.0);
      }
    });
  };
  switch (x.scalar_type()) {
    case at::kFloat: {
      const float* p = x.const_data_ptr<float>();
      run([p](int64_t i) { return static_cast<double>(p[i]); });
      break;
    }
    case at::kHalf: {
      const at::Half* p = x.const_data_ptr<at::Half>();
      run([p](int64_t i) { return static_cast<double>(static_cast<float>(p[i])); });
      break;
    }
    default: {
      const at::BFloat16* p = x.const_data_ptr<at::BFloat16>();
      run([p](int64_t i) { return static_cast<double>(static_cast<float>(p[i])); });
      break;
    }
  }
}

at::Tensor hadamard_rotate_f64(const at::Tensor& a, int64_t rs, double c) {
  const at::ScalarType st = a.scalar_type();
  TORCH_CHECK_VALUE(st == at::kFloat || st == at::kHalf || st == at::kBFloat16, "mxq.hadamard_rotate_f64: argument 'a': dtype ",
                    st, ", expected float32, float16 or bfloat16");
  TORCH_CHECK_VALUE(a.dim() >= 1, "mxq.hadamard_rotate_f64: argument 'a': a 0-dimensional tensor, expected [..., K]");
  TORCH_CHECK_VALUE(rs >= 16 && rs <= 256 && (rs & (rs - 1)) == 0, "mxq.hadamard_rotate_f64: argument 'rs': ",
                    std::to_string(rs), ", expected a power of two in [16, 256]");
  TORCH_CHECK_VALUE(a.size(-1) % rs == 0, "mxq.hadamard_rotate_f64: argument 'a': shape ", shape_str(a),
                    ", expected K (the last dimension) to be a multiple of rs = ", std::to_string(rs));
  at::Tensor y = at::empty(a.sizes(), a.options().dtype(at::kFloat).memory_format(at::MemoryFormat::Contiguous));
  const int64_t groups = a.numel() / rs;
  if (groups == 0) return y;
  const at::Tensor x = a.contiguous();
  if (!x.is_cuda()) {
    hadamard_groups_cpu(x, y.data_ptr<float>(), groups, rs, c);
    return y;
  }
#if defined(MXQ_TORCH_CUDA)
  DeviceContext ctx(x);
  const int dtype = st == at::kFloat ? 0 : st == at::kHalf ? 1 : 2;
  const cudaError_t e = hadamard_rotate_f64_cuda(x.const_data_ptr(), dtype, y.data_ptr<float>(), groups, static_cast<int>(rs), c,
                                                 static_cast<cudaStream_t>(ctx.stream));
  TORCH_CHECK(e == cudaSuccess, "mxq.hadamard_rotate_f64: the CUDA kernel did not launch: ", cudaGetErrorString(e));
  return y;
#else
  TORCH_CHECK_NOT_IMPLEMENTED(false, "mxq.hadamard_rotate_f64: a CUDA tensor, but the extension was built without CUDA");
#endif
}

// A boxed kernel for m.impl: void(op, stack), or void(op, keys, stack) where it redispatches.
template <auto kernel>
torch::CppFunction boxed() {
  return torch::CppFunction::makeFromBoxedFunction<kernel>();
}

// ---- autograd -------------------------------------------------------------------------------------
// Kernels of the Autograd dispatch key: qdq and qdq_ pass gradients straight through (the
// straight-through estimator: grad_x = grad_y); quantize and dequantize refuse inputs that require a
// gradient (their codes are integers: the graph would be cut, the gradients upstream silently None).
// Without a gradient to record they redispatch below autograd at once, the arguments as they came
// (with the key set the dispatcher handed them: no thread-local guard): this is the inference path.
// NOTE: C++ kernels, not torch.library.register_autograd: that one is a Python function the
// dispatcher enters on every call, gradient or not (a few microseconds per call).
bool needs_grad(const at::Tensor& t) { return t.defined() && t.requires_grad() && at::GradMode::is_enabled(); }

void below_autograd(const c10::OperatorHandle& op, c10::DispatchKeySet ks, torch::jit::Stack* stack) {
  op.redispatchBoxed(ks & c10::after_ADInplaceOrView_keyset, stack);
}

// The straight-through gradient of a rotated QDQ is grad_y @ R^T (the result is in the rotated domain),
// which mxq does not compute: refused rather than returned wrong.
void refuse_rotated_gradient(const Args& a) {
  const std::string_view rotation = a[kRotation].toStringView();
  const bool matrix = !a[kRotationMatrix].isNone();
  TORCH_CHECK_NOT_IMPLEMENTED((rotation == "none" || rotation.empty()) && !matrix,
                              "mxq." + std::string(a.op().name) + ": argument 'rotation' = '" +
                                  std::string(matrix ? "a matrix" : rotation) +
                                  "' with x requiring grad: the gradient of a rotated qdq (grad_y @ R^T) is not implemented; "
                                  "call it under torch.no_grad() or on x.detach()");
}

// hadamard_rotate_f64 has no gradient (the QuTLASS shim calls it under no_grad): refused on an input
// that requires one, rather than an output silently cut from the graph.
void hadamard_rotate_autograd(const c10::OperatorHandle& op, c10::DispatchKeySet ks, torch::jit::Stack* stack) {
  TORCH_CHECK_NOT_IMPLEMENTED(!needs_grad(torch::jit::peek(*stack, 0, 3).toTensor()),
                              "mxq.hadamard_rotate_f64: argument 'a' requires grad: the rotation has no gradient in mxq; "
                              "call it under torch.no_grad() or on a.detach()");
  below_autograd(op, ks, stack);
}

// y = qdq(x, options...) with grad_x = grad_y; `options` are the call's arguments after x (qdq's and
// qdq_'s are one list).
struct QdqStraightThrough : public torch::autograd::Function<QdqStraightThrough> {
  static at::Tensor forward(torch::autograd::AutogradContext*, const at::Tensor& x, const torch::jit::Stack& options) {
    static const c10::OperatorHandle op = c10::Dispatcher::singleton().findSchemaOrThrow("mxq::qdq", "");
    torch::jit::Stack s;
    s.reserve(1 + options.size());
    s.emplace_back(x);
    s.insert(s.end(), options.begin(), options.end());
    at::AutoDispatchBelowADInplaceOrView below;
    op.callBoxed(s);
    return s.back().toTensor();
  }
  static torch::autograd::variable_list backward(torch::autograd::AutogradContext*,
                                                 torch::autograd::variable_list grad) {
    return {grad[0], {}};  // one per forward argument: x's gradient, none for the options
  }
};

void qdq_autograd(const c10::OperatorHandle& op, c10::DispatchKeySet ks, torch::jit::Stack* stack) {
  const Args a(kQdq, *stack);
  const at::Tensor& x = a.input(0).toTensor();  // on the stack until the redispatch or a.ret
  if (!needs_grad(x)) return below_autograd(op, ks, stack);
  refuse_rotated_gradient(a);
  at::Tensor y = QdqStraightThrough::apply(x, a.options());
  a.ret(*stack, std::move(y));
}

// In place, as torch's in-place ops: refused on a leaf that requires grad (and on a view of one);
// elsewhere x's history continues through the straight-through estimator (x.copy_(qdq(x)) records
// exactly that); the version counter moves (copy_, or the ADInplaceOrView kernel below), so a
// backward that saved x fails loudly.
void qdq_inplace_autograd(const c10::OperatorHandle& op, c10::DispatchKeySet ks, torch::jit::Stack* stack) {
  const Args a(kQdqInplace, *stack);
  const at::Tensor& x = a.input(0).toTensor();
  if (!needs_grad(x)) return op.redispatchBoxed(ks & c10::after_autograd_keyset, stack);
  TORCH_CHECK(!x.is_leaf(), "mxq.qdq_: a leaf Variable that requires grad is being used in an in-place operation "
              "(use mxq.qdq, or overwrite it under torch.no_grad())");
  refuse_rotated_gradient(a);
  x.copy_(QdqStraightThrough::apply(x, a.options()));
  a.ret(*stack);
}

// The ADInplaceOrView kernel of qdq_, as torch's generated ones for its in-place ops: the version
// counter moves after the write, also under torch.inference_mode() (which skips the Autograd key).
void qdq_inplace_version(const c10::OperatorHandle& op, c10::DispatchKeySet ks, torch::jit::Stack* stack) {
  const at::Tensor x = Args(kQdqInplace, *stack).input(0).toTensor();  // a copy: the redispatch consumes the stack
  {
    at::AutoDispatchBelowADInplaceOrView below;
    op.redispatchBoxed(ks & c10::after_ADInplaceOrView_keyset, stack);
  }
  torch::autograd::impl::bump_version(x);
}

void quantize_autograd(const c10::OperatorHandle& op, c10::DispatchKeySet ks, torch::jit::Stack* stack) {
  TORCH_CHECK(!needs_grad(Args(kQuantize, *stack).input(0).toTensor()),
              "mxq.quantize is not differentiable: argument 'x' requires grad, and its integer codes "
              "cannot carry a gradient back to it. Call it under torch.no_grad() or on x.detach(); for "
              "quantization-aware training use mxq.qdq (its gradient is the straight-through estimator)");
  below_autograd(op, ks, stack);
}

void dequantize_autograd(const c10::OperatorHandle& op, c10::DispatchKeySet ks, torch::jit::Stack* stack) {
  const c10::IValue& ts = Args(kDequantize, *stack)[kTensorScaleTensor];
  TORCH_CHECK(!(ts.isTensor() && needs_grad(ts.toTensor())),
              "mxq.dequantize is not differentiable: argument 'tensor_scale' requires grad. Pass it detached "
              "(tensor_scale.detach()) or call under torch.no_grad(); for quantization-aware training use mxq.qdq");
  below_autograd(op, ks, stack);
}

// The fused producers have no gradient (emulation at inference): refused when one is wanted, instead of
// an output silently cut from the graph.
void rms_norm_autograd(const c10::OperatorHandle& op, c10::DispatchKeySet ks, torch::jit::Stack* stack) {
  const Args a(kRmsNorm, *stack);
  TORCH_CHECK_NOT_IMPLEMENTED(!needs_grad(a.input(0).toTensor()) && !needs_grad(a.input(1).toTensor()),
                              "mxq.rms_norm has no gradient; call it under torch.no_grad() or on detached tensors");
  below_autograd(op, ks, stack);
}

void silu_mul_autograd(const c10::OperatorHandle& op, c10::DispatchKeySet ks, torch::jit::Stack* stack) {
  const Args a(kSiluMul, *stack);
  TORCH_CHECK_NOT_IMPLEMENTED(!needs_grad(a.input(0).toTensor()) && !needs_grad(a.input(1).toTensor()),
                              "mxq.silu_mul has no gradient; call it under torch.no_grad() or on detached tensors");
  below_autograd(op, ks, stack);
}


// ---- W4A16 linear -----------------------------------------------------------------------------------
// prepack: codes u8 [N, K/2] and scales (u8 or float8_e4m3fn) [N, K/g] linear, or the 128x4 swizzled
// layout, on the CPU -> the packed codes and scales (CPU) and info int64 [2] = (exp_shift, f16_exact).
std::tuple<at::Tensor, at::Tensor, at::Tensor> prepack(const at::Tensor& codes, const at::Tensor& scales, int64_t N, int64_t K,
                                                       c10::string_view format, c10::string_view layout) {
  mxq::Format f{};
  guarded([&] {
    f = mxq::parse_format(format);
    return 0;
  });
  TORCH_CHECK_VALUE(layout == "linear" || layout == "swizzled", "mxq.prepack: argument 'layout': '", std::string(layout),
                    "', expected 'linear' or 'swizzled'");
  TORCH_CHECK_VALUE(!codes.is_cuda() && !scales.is_cuda(), "mxq.prepack: codes and scales must be CPU tensors (prepack runs once, on the host)");
  TORCH_CHECK_VALUE(codes.scalar_type() == at::kByte, "mxq.prepack: argument 'codes': dtype ", codes.scalar_type(), ", expected uint8");
  TORCH_CHECK_VALUE(scales.scalar_type() == at::kByte || scales.scalar_type() == at::kFloat8_e4m3fn, "mxq.prepack: argument 'scales': dtype ",
                    scales.scalar_type(), ", expected uint8 (or float8_e4m3fn for nvfp4)");
  TORCH_CHECK_VALUE(codes.dim() == 2 && scales.dim() == 2, "mxq.prepack: codes and scales must be 2-D, got ", shape_str(codes), " and ",
                    shape_str(scales));
  const at::Tensor c = codes.contiguous();
  const at::Tensor sc = (scales.scalar_type() == at::kByte ? scales : scales.view(at::kByte)).contiguous();
  mxq::QuantOptions o = f == mxq::Format::nvfp4 ? mxq::QuantOptions::nvfp4(1.0f) : mxq::QuantOptions::mx(f, mxq::ScaleRule::floor);
  o.scale_layout = layout == "swizzled" ? mxq::ScaleLayout::swizzled : mxq::ScaleLayout::linear;
  mxq::PackedWeight w;
  w.format = f;
  w.N = N;
  w.K = K;
  at::Tensor pc, ps;
  guarded([&] {
    const mxq::PackedLayout L = mxq::packed_layout(f, N, K);
    pc = at::empty({L.codes.rows, L.codes.cols}, c.options());
    ps = at::empty({L.scales.rows, L.scales.cols}, c.options());
    w.codes = mxq::Tensor{pc.data_ptr(), mxq::DType::u8, L.codes.rows, L.codes.cols, 0, mxq::Device::cpu};
    w.scales = mxq::Tensor{ps.data_ptr(), mxq::DType::u8, L.scales.rows, L.scales.cols, 0, mxq::Device::cpu};
    mxq::prepack({mxq::Tensor{c.data_ptr(), mxq::DType::u8, c.size(0), c.size(1), 0, mxq::Device::cpu},
                  mxq::Tensor{sc.data_ptr(), mxq::DType::u8, sc.size(0), sc.size(1), 0, mxq::Device::cpu}},
                 o, w);
    return 0;
  });
  at::Tensor info = at::empty({2}, c.options().dtype(at::kLong));
  info[0] = w.exp_shift;
  info[1] = w.f16_exact ? 1 : 0;
  return {pc, ps, info};
}

// unpack: the packed codes and scales (CPU) -> codes u8 [N, K/2] and linear scales u8 [N, K/g].
std::tuple<at::Tensor, at::Tensor> unpack(const at::Tensor& pc, const at::Tensor& ps, int64_t N, int64_t K, c10::string_view format,
                                          int64_t exp_shift) {
  mxq::PackedWeight w;
  guarded([&] {
    w.format = mxq::parse_format(format);
    return 0;
  });
  TORCH_CHECK_VALUE(!pc.is_cuda() && !ps.is_cuda() && pc.scalar_type() == at::kByte && ps.scalar_type() == at::kByte,
                    "mxq.unpack: the packed codes and scales must be uint8 CPU tensors");
  w.N = N;
  w.K = K;
  w.exp_shift = int(exp_shift);
  const at::Tensor c = pc.contiguous(), s = ps.contiguous();
  w.codes = mxq::Tensor{c.data_ptr(), mxq::DType::u8, c.dim() == 2 ? c.size(0) : 0, c.dim() == 2 ? c.size(1) : 0, 0, mxq::Device::cpu};
  w.scales = mxq::Tensor{s.data_ptr(), mxq::DType::u8, s.dim() == 2 ? s.size(0) : 0, s.dim() == 2 ? s.size(1) : 0, 0, mxq::Device::cpu};
  const int64_t g = w.format == mxq::Format::nvfp4 ? 16 : 32;
  at::Tensor codes = at::empty({N, (K + 1) / 2}, c.options()), scales = at::empty({N, K / g}, c.options());
  guarded([&] {
    mxq::unpack(w, {mxq::Tensor{codes.data_ptr(), mxq::DType::u8, N, (K + 1) / 2, 0, mxq::Device::cpu},
                    mxq::Tensor{scales.data_ptr(), mxq::DType::u8, N, K / g, 0, mxq::Device::cpu}});
    return 0;
  });
  return {codes, scales};
}

// From this many rows of x on, the CUDA op multiplies through cuBLAS (dequantize_packed + an fp32-output
// GEMM) instead of mxq's kernel, which re-reads the weights per 64 or 128 rows: at M = 256 the kernel was
// still faster on the H100 (4096^2: 42.2 against 51.6 us; 8192^2: 139.6 against 150.1), at M = 1024
// cuBLAS (docs/performance.md). MXQ_LINEAR_CUBLAS_M overrides it (benchmarks).
int64_t linear_cublas_from_m() {
  static const int64_t m = [] {
    const char* e = std::getenv("MXQ_LINEAR_CUBLAS_M");
    return e && *e ? std::max<int64_t>(1, std::atoll(e)) : int64_t(257);
  }();
  return m;
}

// linear: y [..., N] = x [..., K] @ W^T (+ bias), W prepacked (codes, scales on x's device).
at::Tensor linear(const at::Tensor& x, const at::Tensor& pc, const at::Tensor& ps, const std::optional<at::Tensor>& bias,
                  c10::string_view format, int64_t N, int64_t K, int64_t exp_shift, bool f16_exact, double tensor_scale) {
  const mxq::DType dt = dtype_of(x, "linear", "x", false);
  const Rows xr = as_rows(x, "linear", "x");
  mxq::PackedWeight w;
  guarded([&] {
    w.format = mxq::parse_format(format);
    return 0;
  });
  for (const at::Tensor* t : {&pc, &ps})
    TORCH_CHECK_VALUE(t->scalar_type() == at::kByte && t->dim() == 2 && t->is_contiguous() && t->device() == x.device(),
                      "mxq.linear: the packed weight's codes and scales must be contiguous 2-D uint8 tensors on x's device (",
                      device_name(x), "), got ", t->scalar_type(), " ", shape_str(*t), " on ", device_name(*t));
  w.N = N;
  w.K = K;
  w.exp_shift = int(exp_shift);
  w.f16_exact = f16_exact;
  w.tensor_scale = float(tensor_scale);
  w.codes = mxq::Tensor{pc.data_ptr(), mxq::DType::u8, pc.size(0), pc.size(1), 0, mxq_device(pc)};
  w.scales = mxq::Tensor{ps.data_ptr(), mxq::DType::u8, ps.size(0), ps.size(1), 0, mxq_device(ps)};
  at::Tensor b;
  mxq::Tensor bv;
  if (bias) {
    TORCH_CHECK_VALUE(bias->dim() == 1 && bias->size(0) == N && bias->scalar_type() == x.scalar_type() && bias->device() == x.device(),
                      "mxq.linear: argument 'bias': ", bias->scalar_type(), " ", shape_str(*bias), " on ", device_name(*bias),
                      ", expected x's dtype ", x.scalar_type(), " [", std::to_string(N), "] on ", device_name(x));
    b = bias->contiguous();
    bv = mxq::Tensor{b.data_ptr(), dt, 1, N, 0, mxq_device(b)};
  }
  at::Tensor y = at::empty(with_last(x.sizes(), N), x.options().memory_format(at::MemoryFormat::Contiguous));
  mxq::Tensor xv = view(xr, dt);
  at::Tensor xc;
  if (x.is_cuda() && (reinterpret_cast<std::uintptr_t>(xv.data) % 16 != 0 || (xv.stride() * 2) % 16 != 0)) {
    xc = xr.t.reshape({xr.rows, xr.cols}).contiguous();  // the kernel reads x in 16-byte vectors
    if (reinterpret_cast<std::uintptr_t>(xc.data_ptr()) % 16 != 0) xc = xc.clone();
    xv = mxq::Tensor{xc.data_ptr(), dt, xr.rows, xr.cols, 0, mxq_device(xc)};
  }
  DeviceContext ctx(x);
  if (x.is_cuda() && xr.rows >= linear_cublas_from_m()) {
    // Large M: the weight as the kernel's operand (exact) through cuBLAS with fp32 output, then the
    // kernel's epilogue in fp32: times 2^exp_shift (exact), / S, + bias, rounded once (docs/linear.md).
    at::Tensor wt = at::empty({N, K}, x.options().memory_format(at::MemoryFormat::Contiguous));
    guarded([&] {
      mxq::dequantize_packed(w, mxq::Tensor{wt.data_ptr(), dt, N, K, 0, mxq_device(wt)}, mxq::Backend::automatic, ctx.stream);
      return 0;
    });
    at::Tensor y32 = at::mm(xr.t.reshape({xr.rows, K}), wt.t(), at::kFloat);
    if (exp_shift != 0) y32.mul_(std::ldexp(1.0, static_cast<int>(exp_shift)));
    // NOTE: / S as a division: a divisor that is a CPU scalar makes torch's CUDA kernel multiply by its
    // reciprocal (1 ulp off in fp32; one fp16 output of test_linear differed on the H200), a tensor does not.
    if (w.format == mxq::Format::nvfp4) y32.div_(at::full({}, static_cast<double>(w.tensor_scale), y32.options()));
    if (bias) y32.add_(b.to(at::kFloat));
    y.view({xr.rows, N}).copy_(y32);
    return y;
  }
  guarded([&] {
    mxq::linear(xv, w, bias ? &bv : nullptr, mxq::Tensor{y.data_ptr(), dt, xr.rows, N, 0, mxq_device(y)}, mxq::Backend::automatic,
                ctx.stream);
    return 0;
  });
  return y;
}


// ---- W4A16 MoE ----------------------------------------------------------------------------------------
// moe: y [..., H] for x [..., H] routed by topk_ids / topk_weights [..., k], the experts' packed tensors
// (PackedExperts' four tensors per GEMM) on x's device. Returns (y, error_flag int32 [1]): the CUDA path's
// flag of an expert id out of range (its pairs dropped); 0 on the CPU, which raises instead. The CUDA path
// allocates its workspace (mxq::moe_workspace) through the caching allocator: no host synchronisation.
std::tuple<at::Tensor, at::Tensor> moe(const at::Tensor& x, const at::Tensor& c13, const at::Tensor& s13, const at::Tensor& d13,
                                       const at::Tensor& t13, const std::optional<at::Tensor>& b13, const at::Tensor& c2,
                                       const at::Tensor& s2, const at::Tensor& d2, const at::Tensor& t2,
                                       const std::optional<at::Tensor>& b2, const at::Tensor& topk_ids, const at::Tensor& topk_weights,
                                       c10::string_view format, int64_t I, bool f16_exact, c10::string_view activation, double alpha,
                                       double limit) {
  const mxq::DType dt = dtype_of(x, "moe", "x", false);
  mxq::Format f{};
  mxq::MoeActivation act{};
  guarded([&] {
    f = mxq::parse_format(format);
    act = mxq::parse_moe_activation(activation);
    return 0;
  });
  TORCH_CHECK_VALUE(x.dim() >= 1, "mxq.moe: argument 'x': a 0-dimensional tensor, expected [..., H]");
  const at::Tensor xc = x.reshape({-1, x.size(-1)}).contiguous();
  const int64_t T = xc.size(0), H = xc.size(1);
  TORCH_CHECK_VALUE(topk_ids.dim() >= 1 && (topk_ids.scalar_type() == at::kInt || topk_ids.scalar_type() == at::kLong),
                    "mxq.moe: argument 'topk_ids': ", topk_ids.scalar_type(), " ", shape_str(topk_ids), ", expected int32 or int64 [..., k]");
  const int64_t k = topk_ids.size(-1);
  TORCH_CHECK_VALUE(k >= 1 && topk_ids.numel() == T * k, "mxq.moe: argument 'topk_ids': shape ", shape_str(topk_ids),
                    ", expected one row of k >= 1 expert ids per row of x (", std::to_string(T), " rows)");
  TORCH_CHECK_VALUE(topk_weights.sizes() == topk_ids.sizes(), "mxq.moe: argument 'topk_weights': shape ", shape_str(topk_weights),
                    ", expected topk_ids' shape ", shape_str(topk_ids));
  const at::Tensor ids = topk_ids.reshape({T, k}).contiguous(), tw = topk_weights.reshape({T, k}).contiguous();
  const mxq::DType twt = dtype_of(tw, "moe", "topk_weights", false);
  auto experts = [&](const char* name, const at::Tensor& c, const at::Tensor& s, const at::Tensor& d, const at::Tensor& t,
                     int64_t N, int64_t K) {
    TORCH_CHECK_VALUE(c.scalar_type() == at::kByte && s.scalar_type() == at::kByte && c.dim() == 2 && s.dim() == 2 &&
                          c.is_contiguous() && s.is_contiguous() && c.device() == x.device() && s.device() == x.device(),
                      "mxq.moe: ", name, "'s codes and scales must be contiguous 2-D uint8 tensors [E, bytes] on x's device (",
                      device_name(x), "), got ", shape_str(c), " and ", shape_str(s), " on ", device_name(c));
    TORCH_CHECK_VALUE(d.scalar_type() == at::kInt && t.scalar_type() == at::kFloat && d.dim() == 1 && t.dim() == 1 &&
                          d.is_contiguous() && t.is_contiguous() && d.device() == x.device() && t.device() == x.device(),
                      "mxq.moe: ", name, "'s exp_shift and tensor_scale must be contiguous int32 [E] and float32 [E] on x's device");
    mxq::PackedExperts w;
    w.format = f;
    w.E = c.size(0);
    w.N = N;
    w.K = K;
    w.codes = mxq::Tensor{c.data_ptr(), mxq::DType::u8, c.size(0), c.size(1), 0, mxq_device(c)};
    w.scales = mxq::Tensor{s.data_ptr(), mxq::DType::u8, s.size(0), s.size(1), 0, mxq_device(s)};
    w.exp_shift = mxq::Tensor{d.data_ptr(), mxq::DType::i32, 1, d.size(0), 0, mxq_device(d)};
    w.tensor_scale = mxq::Tensor{t.data_ptr(), mxq::DType::f32, 1, t.size(0), 0, mxq_device(t)};
    w.f16_exact = f16_exact;
    return w;
  };
  const int64_t N13 = act == mxq::MoeActivation::none ? I : 2 * I;
  const mxq::PackedExperts w13 = experts("w13", c13, s13, d13, t13, N13, H), w2 = experts("w2", c2, s2, d2, t2, H, I);
  at::Tensor b13c, b2c;
  mxq::Tensor b13v, b2v;
  for (auto [name, b, bc, bv, N] : {std::tuple{"b13", &b13, &b13c, &b13v, N13}, {"b2", &b2, &b2c, &b2v, H}}) {
    if (!*b) continue;
    const at::Tensor& t = **b;
    TORCH_CHECK_VALUE(t.dim() == 2 && t.scalar_type() == x.scalar_type() && t.device() == x.device(), "mxq.moe: argument '", name,
                      "': ", t.scalar_type(), " ", shape_str(t), " on ", device_name(t), ", expected x's dtype [E, ", std::to_string(N),
                      "] on ", device_name(x));
    *bc = t.contiguous();
    *bv = mxq::Tensor{bc->data_ptr(), dt, bc->size(0), bc->size(1), 0, mxq_device(*bc)};
  }
  at::Tensor y = at::empty(x.sizes(), x.options().memory_format(at::MemoryFormat::Contiguous));
  at::Tensor flag = at::zeros({1}, x.options().dtype(at::kInt));
  const mxq::Tensor xv{xc.data_ptr(), dt, T, H, 0, mxq_device(xc)}, yv{y.data_ptr(), dt, T, H, 0, mxq_device(y)};
  const mxq::Tensor idv{ids.data_ptr(), ids.scalar_type() == at::kInt ? mxq::DType::i32 : mxq::DType::i64, T, k, 0, mxq_device(ids)};
  const mxq::Tensor twv{tw.data_ptr(), twt, T, k, 0, mxq_device(tw)};
  DeviceContext ctx(x);
  at::Tensor ws;
  mxq::Tensor wsv;
  int64_t flag_at = 0;
  if (x.is_cuda()) {
    const mxq::MoeWorkspace L = guarded([&] { return mxq::moe_workspace(T, k, w13.E, N13, I, H, act); });
    ws = at::empty({1, L.bytes}, x.options().dtype(at::kByte));
    wsv = mxq::Tensor{ws.data_ptr(), mxq::DType::u8, 1, L.bytes, 0, mxq::Device::cuda};
    flag_at = L.error_flag;
  }
  guarded([&] {
    mxq::moe(xv, w13, b13 ? &b13v : nullptr, w2, b2 ? &b2v : nullptr, idv, twv, act, float(alpha), float(limit), yv,
             x.is_cuda() ? &wsv : nullptr, mxq::Backend::automatic, ctx.stream);
    return 0;
  });
  if (x.is_cuda()) flag.copy_(ws.narrow(1, flag_at, 4).view(at::kInt).reshape({1}));
  return {y, flag};
}
}  // namespace
}  // namespace mxq_torch

TORCH_LIBRARY(mxq, m) {
  // qdq, qdq_, quantize, dequantize, rms_norm, silu_mul: written from their options (OpSpec)
  for (const mxq_torch::OpSpec* op : mxq_torch::kOpSpecs) m.def(torch::schema(op->schema().c_str()));
  m.def("swizzle_scales(Tensor linear) -> Tensor");
  m.def("unswizzle_scales(Tensor swizzled, SymInt rows, SymInt cols) -> Tensor");
  m.def("prepack(Tensor codes, Tensor scales, int N, int K, str format, str layout) -> (Tensor codes, Tensor scales, Tensor info)");
  m.def("unpack(Tensor codes, Tensor scales, int N, int K, str format, int exp_shift) -> (Tensor codes, Tensor scales)");
  m.def("linear(Tensor x, Tensor codes, Tensor scales, Tensor? bias, str format, int N, int K, int exp_shift, bool f16_exact, "
        "float tensor_scale) -> Tensor");
  m.def("moe(Tensor x, Tensor w13_codes, Tensor w13_scales, Tensor w13_exp_shift, Tensor w13_tensor_scale, Tensor? b13, "
        "Tensor w2_codes, Tensor w2_scales, Tensor w2_exp_shift, Tensor w2_tensor_scale, Tensor? b2, Tensor topk_ids, "
        "Tensor topk_weights, str format, int I, bool f16_exact, str activation, float alpha, float limit) -> (Tensor, Tensor)");
  m.def("hadamard_rotate_f64(Tensor a, int rs, float c) -> Tensor");
}

TORCH_LIBRARY_IMPL(mxq, CPU, m) {
  using mxq_torch::boxed;
  m.impl("rms_norm", boxed<&mxq_torch::rms_norm>());
  m.impl("silu_mul", boxed<&mxq_torch::silu_mul>());
  m.impl("qdq", boxed<&mxq_torch::qdq>());
  m.impl("qdq_", boxed<&mxq_torch::qdq_>());
  m.impl("quantize", boxed<&mxq_torch::quantize>());
  m.impl("dequantize", boxed<&mxq_torch::dequantize>());
  m.impl("swizzle_scales", &mxq_torch::swizzle_scales);
  m.impl("unswizzle_scales", &mxq_torch::unswizzle_scales);
  m.impl("prepack", &mxq_torch::prepack);
  m.impl("unpack", &mxq_torch::unpack);
  m.impl("linear", &mxq_torch::linear);
  m.impl("moe", &mxq_torch::moe);
  m.impl("hadamard_rotate_f64", &mxq_torch::hadamard_rotate_f64);
}

// NOTE: registered even when the library was built without CUDA, so that CUDA tensors get mxq's own
// message ("the CUDA backend cannot run: ...") instead of the dispatcher's missing-kernel error.
TORCH_LIBRARY_IMPL(mxq, CUDA, m) {
  using mxq_torch::boxed;
  m.impl("rms_norm", boxed<&mxq_torch::rms_norm>());
  m.impl("silu_mul", boxed<&mxq_torch::silu_mul>());
  m.impl("qdq", boxed<&mxq_torch::qdq>());
  m.impl("qdq_", boxed<&mxq_torch::qdq_>());
  m.impl("quantize", boxed<&mxq_torch::quantize>());
  m.impl("dequantize", boxed<&mxq_torch::dequantize>());
  m.impl("swizzle_scales", &mxq_torch::swizzle_scales);
  m.impl("unswizzle_scales", &mxq_torch::unswizzle_scales);
  m.impl("linear", &mxq_torch::linear);
  m.impl("moe", &mxq_torch::moe);
  m.impl("hadamard_rotate_f64", &mxq_torch::hadamard_rotate_f64);
}

TORCH_LIBRARY_IMPL(mxq, ADInplaceOrView, m) { m.impl("qdq_", mxq_torch::boxed<&mxq_torch::qdq_inplace_version>()); }

TORCH_LIBRARY_IMPL(mxq, Autograd, m) {
  using mxq_torch::boxed;
  m.impl("rms_norm", boxed<&mxq_torch::rms_norm_autograd>());
  m.impl("silu_mul", boxed<&mxq_torch::silu_mul_autograd>());
  m.impl("qdq", boxed<&mxq_torch::qdq_autograd>());
  m.impl("qdq_", boxed<&mxq_torch::qdq_inplace_autograd>());
  m.impl("quantize", boxed<&mxq_torch::quantize_autograd>());
  m.impl("dequantize", boxed<&mxq_torch::dequantize_autograd>());
  // uint8 in, uint8 out: nothing can require grad; registered so that no call takes torch's boxed fallback.
  m.impl("swizzle_scales", boxed<&mxq_torch::below_autograd>());
  m.impl("unswizzle_scales", boxed<&mxq_torch::below_autograd>());
  m.impl("hadamard_rotate_f64", boxed<&mxq_torch::hadamard_rotate_autograd>());
}

// The extension is imported as the Python module mxq._C: importing it registers the ops above; its two
// functions tell how the library was built.
namespace {
PyObject* py_cuda_compiled(PyObject*, PyObject*) { return PyBool_FromLong(mxq::cuda_compiled() ? 1 : 0); }
PyObject* py_cuda_available(PyObject*, PyObject*) {
  std::string why;
  const bool ok = mxq::cuda_available(&why);
  return Py_BuildValue("(Os)", ok ? Py_True : Py_False, why.c_str());
}
PyMethodDef mxq_c_methods[] = {
    {"cuda_compiled", py_cuda_compiled, METH_NOARGS, "Whether libmxq was built with its CUDA backend."},
    {"cuda_available", py_cuda_available, METH_NOARGS,
     "(usable, why_not): whether the CUDA backend can run here, and why not."},
    {nullptr, nullptr, 0, nullptr}};
PyModuleDef mxq_c_module = {PyModuleDef_HEAD_INIT, "_C", "mxq's torch.library ops (torch.ops.mxq)", -1,
                            mxq_c_methods, nullptr, nullptr, nullptr, nullptr};
}  // namespace
PyMODINIT_FUNC PyInit__C() { return PyModule_Create(&mxq_c_module); }
